package wsgate.interop;

import com.google.gson.JsonArray;
import com.google.gson.JsonObject;
import java.security.MessageDigest;
import java.security.cert.X509Certificate;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HexFormat;
import java.util.List;
import java.util.Map;
import javax.xml.namespace.QName;
import org.apache.wss4j.common.token.Reference;
import org.apache.wss4j.dom.WSConstants;
import org.apache.wss4j.dom.WSDataRef;
import org.apache.wss4j.dom.engine.WSSConfig;
import org.apache.wss4j.dom.engine.WSSecurityEngine;
import org.apache.wss4j.dom.engine.WSSecurityEngineResult;
import org.apache.wss4j.dom.handler.RequestData;
import org.apache.wss4j.dom.handler.WSHandlerResult;
import org.apache.wss4j.dom.message.token.DerivedKeyToken;
import org.w3c.dom.Document;

/**
 * `verify`: WSS4J's WSSecurityEngine over a secured message, Basic Security Profile enforcement on (WSS4J's
 * default) unless "bsp": false. {"xml", "trust": [CA PEM], "key"/"cert": who decrypts, "secrets": {identifier:
 * base64}, "users": {name: password}, "attachments": [...] (Attachments.java)} -> what was signed (by whom, with which
 * key), what was decrypted, the contexts derived keys came from, and the processed envelope.
 */
final class Verify {
    private static final Map<Integer, String> ACTIONS = Map.of(
        WSConstants.UT, "UsernameToken", WSConstants.SIGN, "Signature", WSConstants.ENCR, "Encrypt",
        WSConstants.TS, "Timestamp", WSConstants.SCT, "SecurityContextToken", WSConstants.DKT, "DerivedKeyToken",
        WSConstants.BST, "BinarySecurityToken");

    private final JsonObject req;
    private final Secrets secrets;

    Verify(JsonObject req, Secrets secrets) {
        this.req = req;
        this.secrets = secrets;
    }

    JsonObject run() throws Exception {
        Document doc = Xml.parse(req.get("xml").getAsString());
        List<String> anchors = new ArrayList<>();
        if (req.has("trust")) {
            req.getAsJsonArray("trust").forEach(a -> anchors.add(a.getAsString()));
        }
        String[] trust = anchors.toArray(new String[0]);
        if (req.has("secrets")) {
            Map<String, String> given = new java.util.HashMap<>();
            req.getAsJsonObject("secrets").entrySet().forEach(e -> given.put(e.getKey(), e.getValue().getAsString()));
            secrets.putBase64(given);
        }
        if (req.has("users")) {
            // UsernameToken passwords the receiver knows (the harness as a partner service checking them).
            req.getAsJsonObject("users").entrySet().forEach(e -> secrets.password(e.getKey(), e.getValue().getAsString()));
        }
        RequestData data = new RequestData();
        data.setWssConfig(WSSConfig.getNewInstance());
        data.setCallbackHandler(secrets);
        data.setSigVerCrypto(Pem.crypto(null, null, trust));
        String key = req.has("key") ? req.get("key").getAsString() : null;
        String cert = req.has("cert") ? req.get("cert").getAsString() : null;
        data.setDecCrypto(Pem.crypto(key, cert, trust));
        data.setDisableBSPEnforcement(req.has("bsp") && !req.get("bsp").getAsBoolean());
        Attachments attachments = new Attachments(req.getAsJsonArray("attachments"));
        data.setAttachmentCallbackHandler(attachments);
        data.setExpandXopInclude(Attachments.flag(req, "expand_xop")); // MTOM: signatures over the XOP infoset
        WSHandlerResult result = new WSSecurityEngine().processSecurityHeader(doc, data);
        if (result == null) {
            throw new IllegalStateException("no wsse:Security header for WSS4J to process");
        }
        JsonObject answer = new JsonObject();
        JsonArray actions = new JsonArray();
        JsonArray signed = new JsonArray();
        JsonArray decrypted = new JsonArray();
        JsonArray derivedFrom = new JsonArray();
        for (WSSecurityEngineResult r : result.getResults()) {
            int action = (Integer) r.get(WSSecurityEngineResult.TAG_ACTION);
            actions.add(ACTIONS.getOrDefault(action, Integer.toString(action)));
            if (action == WSConstants.SIGN) {
                names(r, signed);
                answer.addProperty("signature_method", (String) r.get(WSSecurityEngineResult.TAG_SIGNATURE_METHOD));
                X509Certificate signer = (X509Certificate) r.get(WSSecurityEngineResult.TAG_X509_CERTIFICATE);
                if (signer != null) {
                    answer.addProperty("signer", signer.getSubjectX500Principal().getName());
                    answer.addProperty("signer_der", Base64.getEncoder().encodeToString(signer.getEncoded()));
                }
                byte[] secret = (byte[]) r.get(WSSecurityEngineResult.TAG_SECRET);
                if (secret != null) {
                    // The key itself never leaves: its SHA-256 is enough to say which key it was.
                    answer.addProperty("signature_key_sha256",
                        HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(secret)));
                }
            } else if (action == WSConstants.DKT) {
                // The context (or token) a derived key came from, as its SecurityTokenReference names it.
                DerivedKeyToken dkt = (DerivedKeyToken) r.get(WSSecurityEngineResult.TAG_DERIVED_KEY_TOKEN);
                Reference ref = dkt.getSecurityTokenReference().getReference();
                if (ref != null) {
                    derivedFrom.add(ref.getURI());
                }
            } else if (action == WSConstants.ENCR) {
                names(r, decrypted);
                byte[] ephemeral = (byte[]) r.get(WSSecurityEngineResult.TAG_ENCRYPTED_EPHEMERAL_KEY);
                byte[] secret = (byte[]) r.get(WSSecurityEngineResult.TAG_SECRET);
                if (ephemeral != null && secret != null) {
                    // A key the sender sent us (the symmetric binding): kept by its EncryptedKeySHA1, for a reply
                    // signed with it ("sign" with "received"); only the identifier leaves the JVM.
                    String sha1 = Base64.getEncoder().encodeToString(MessageDigest.getInstance("SHA-1").digest(ephemeral));
                    secrets.put(sha1, secret);
                    answer.addProperty("encrypted_key_sha1", sha1);
                }
            }
        }
        answer.add("actions", actions);
        answer.add("signed", signed);
        answer.add("decrypted", decrypted);
        answer.add("derived_from", derivedFrom);
        answer.addProperty("xml", Xml.serialize(doc));
        JsonArray parts = attachments.toJson();
        if (!parts.isEmpty()) {
            answer.add("attachments", parts);
        }
        return answer;
    }

    @SuppressWarnings("unchecked")
    private static void names(WSSecurityEngineResult r, JsonArray into) {
        List<WSDataRef> refs = (List<WSDataRef>) r.get(WSSecurityEngineResult.TAG_DATA_REF_URIS);
        if (refs == null) {
            return;
        }
        for (WSDataRef ref : refs) {
            QName name = ref.getName();
            String id = ref.getWsuId();
            if (id != null && id.startsWith("cid:")) {
                into.add(id); // an attachment (SwA): named by its cid: URI
            } else if (name != null) {
                into.add("{" + name.getNamespaceURI() + "}" + name.getLocalPart());
            }
        }
    }
}
