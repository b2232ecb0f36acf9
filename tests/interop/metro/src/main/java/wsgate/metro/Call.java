package wsgate.metro;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import jakarta.xml.ws.BindingProvider;
import jakarta.xml.ws.Dispatch;
import jakarta.xml.ws.Service;
import java.io.Closeable;
import java.io.StringReader;
import java.io.StringWriter;
import java.net.URL;
import java.net.URLClassLoader;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import javax.net.ssl.HttpsURLConnection;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManagerFactory;
import javax.xml.namespace.QName;
import javax.xml.transform.Source;
import javax.xml.transform.TransformerFactory;
import javax.xml.transform.stream.StreamResult;
import javax.xml.transform.stream.StreamSource;

/**
 * One client session: Metro reads the gateway's published WSDL at "wsdl" and its WS-SecurityPolicy as they are
 * (Service.create + a PAYLOAD Dispatch on "port" of "service"); only the client's own keys come from here, in
 * the client configuration Metro looks up as META-INF/wsit-client.xml (ClientConfig). Sends each of "payloads"
 * in turn on the one Dispatch (a SecureConversation context is established before the first and reused), then
 * closes it (Metro cancels its contexts then). "endpoint" overrides the WSDL's address (a recording proxy).
 * Answers {"replies": [payload XML...]}.
 */
final class Call {
    private final JsonObject req;

    Call(JsonObject req) {
        this.req = req;
    }

    JsonObject run() throws Exception {
        if (req.has("tls_trust")) { // the WSDL, its imports and the calls: all over HTTPS to the demo CA's gateway
            HttpsURLConnection.setDefaultSSLSocketFactory(sslContext(req).getSocketFactory());
        }
        Path dir = Files.createTempDirectory("metro-client");
        ClientConfig.write(dir, req);
        ClassLoader previous = Thread.currentThread().getContextClassLoader();
        try (URLClassLoader loader = new URLClassLoader(new URL[] {dir.toUri().toURL()}, previous)) {
            Thread.currentThread().setContextClassLoader(loader);
            return invoke();
        } finally {
            Thread.currentThread().setContextClassLoader(previous);
        }
    }

    private JsonObject invoke() throws Exception {
        Service service = Service.create(new URL(req.get("wsdl").getAsString()), qname("service"));
        Dispatch<Source> dispatch = service.createDispatch(qname("port"), Source.class, Service.Mode.PAYLOAD);
        Map<String, Object> ctx = dispatch.getRequestContext();
        if (req.has("endpoint")) {
            ctx.put(BindingProvider.ENDPOINT_ADDRESS_PROPERTY, req.get("endpoint").getAsString());
        }
        if (req.has("action")) {
            ctx.put(BindingProvider.SOAPACTION_USE_PROPERTY, true);
            ctx.put(BindingProvider.SOAPACTION_URI_PROPERTY, req.get("action").getAsString());
        }
        JsonArray replies = new JsonArray();
        try {
            for (JsonElement payload : req.getAsJsonArray("payloads")) {
                Source reply = dispatch.invoke(new StreamSource(new StringReader(payload.getAsString())));
                replies.add(text(reply));
            }
        } finally {
            ((Closeable) dispatch).close();
        }
        JsonObject answer = new JsonObject();
        answer.add("replies", replies);
        return answer;
    }

    private QName qname(String field) {
        return QName.valueOf(req.get(field).getAsString());
    }

    /** TLS that trusts the PEM certificates in "tls_trust" only. */
    static SSLContext sslContext(JsonObject req) throws Exception {
        TrustManagerFactory tmf = TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
        List<String> anchors = new ArrayList<>();
        req.getAsJsonArray("tls_trust").forEach(a -> anchors.add(a.getAsString()));
        tmf.init(Pem.trustStore(anchors));
        SSLContext ssl = SSLContext.getInstance("TLS");
        ssl.init(null, tmf.getTrustManagers(), null);
        return ssl;
    }

    private static String text(Source source) throws Exception {
        StringWriter out = new StringWriter();
        TransformerFactory.newInstance().newTransformer().transform(source, new StreamResult(out));
        return out.toString();
    }
}
