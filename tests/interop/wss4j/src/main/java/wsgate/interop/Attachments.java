package wsgate.interop;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.util.ArrayList;
import java.util.Base64;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import javax.security.auth.callback.Callback;
import javax.security.auth.callback.CallbackHandler;
import javax.security.auth.callback.UnsupportedCallbackException;
import org.apache.wss4j.common.ext.Attachment;
import org.apache.wss4j.common.ext.AttachmentRequestCallback;
import org.apache.wss4j.common.ext.AttachmentResultCallback;

/**
 * The message's attachments as WSS4J's SwA code asks for them: an AttachmentCallbackHandler (as CXF's and WSS4J's
 * own tests implement it) over the JSON list [{"id", "headers": {name: value}, "body": base64}], in order. WSS4J
 * asks for one attachment by id, or for "Attachments" (all of them), and hands back each one it signed over,
 * encrypted or decrypted (AttachmentResultCallback): that replaces the attachment of the same id, or is added
 * (the ciphertext WSS4J stores in an attachment of its own with storeBytesInAttachment).
 */
final class Attachments implements CallbackHandler {
    private final List<Attachment> parts = new ArrayList<>();

    Attachments(JsonArray list) {
        if (list == null) {
            return;
        }
        for (JsonElement e : list) {
            JsonObject o = e.getAsJsonObject();
            Attachment a = new Attachment();
            a.setId(o.get("id").getAsString());
            Map<String, String> headers = new LinkedHashMap<>();
            for (Map.Entry<String, JsonElement> h : o.getAsJsonObject("headers").entrySet()) {
                headers.put(h.getKey(), h.getValue().getAsString());
            }
            a.addHeaders(headers);
            a.setMimeType(headers.getOrDefault("Content-Type", "application/octet-stream"));
            a.setSourceStream(new ByteArrayInputStream(Base64.getDecoder().decode(o.get("body").getAsString())));
            parts.add(a);
        }
    }

    boolean isEmpty() {
        return parts.isEmpty();
    }

    /** Whether the step asked for ciphertext in attachments (an MTOM message) or WSS4J added one. */
    static boolean flag(JsonObject o, String name) {
        return o.has(name) && o.get(name).getAsBoolean();
    }

    @Override
    public void handle(Callback[] callbacks) throws IOException, UnsupportedCallbackException {
        for (Callback c : callbacks) {
            if (c instanceof AttachmentRequestCallback req) {
                List<Attachment> found = new ArrayList<>();
                for (Attachment a : parts) {
                    if ("Attachments".equals(req.getAttachmentId()) || a.getId().equals(req.getAttachmentId())) {
                        found.add(a);
                    }
                }
                req.setAttachments(found);
            } else if (c instanceof AttachmentResultCallback res) {
                Attachment got = res.getAttachment();
                byte[] body = read(got.getSourceStream());
                got.setSourceStream(new ByteArrayInputStream(body));
                boolean replaced = false;
                for (int i = 0; i < parts.size(); i++) {
                    if (parts.get(i).getId().equals(res.getAttachmentId())) {
                        parts.set(i, got);
                        replaced = true;
                    }
                }
                if (!replaced) { // a new one: ciphertext stored in an attachment (storeBytesInAttachment)
                    parts.add(got);
                }
            } else {
                throw new UnsupportedCallbackException(c);
            }
        }
    }

    /** The attachments as they are now: [{"id", "headers", "mime", "body"}]. */
    JsonArray toJson() throws IOException {
        JsonArray out = new JsonArray();
        for (Attachment a : parts) {
            JsonObject o = new JsonObject();
            o.addProperty("id", a.getId());
            o.addProperty("mime", a.getMimeType());
            JsonObject headers = new JsonObject();
            a.getHeaders().forEach(headers::addProperty);
            o.add("headers", headers);
            byte[] body = read(a.getSourceStream());
            a.setSourceStream(new ByteArrayInputStream(body));
            o.addProperty("body", Base64.getEncoder().encodeToString(body));
            out.add(o);
        }
        return out;
    }

    private static byte[] read(InputStream in) throws IOException {
        if (in.markSupported()) {
            in.reset();
        }
        return in.readAllBytes();
    }
}
