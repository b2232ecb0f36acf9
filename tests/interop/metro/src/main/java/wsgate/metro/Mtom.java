package wsgate.metro;

import com.google.gson.JsonObject;
import jakarta.xml.bind.JAXBContext;
import jakarta.xml.bind.annotation.XmlAccessType;
import jakarta.xml.bind.annotation.XmlAccessorType;
import jakarta.xml.bind.annotation.XmlElement;
import jakarta.xml.bind.annotation.XmlRootElement;
import jakarta.xml.ws.Dispatch;
import jakarta.xml.ws.Service;
import jakarta.xml.ws.soap.MTOMFeature;
import jakarta.xml.ws.soap.SOAPBinding;
import java.util.Base64;
import javax.net.ssl.HttpsURLConnection;
import javax.xml.namespace.QName;

/**
 * MTOM as Metro sends it: the demo echo, its d:text a byte[] (xs:base64Binary) that Metro's JAX-WS, with
 * MTOMFeature and a threshold of 0, always sends as an XOP attachment, and reads back from the reply's package.
 * No WSDL: a port added by hand on "endpoint" with the SOAP 1.1 or 1.2 ("soap12") MTOM binding; HTTPS trusts
 * "tls_trust" (as Call).
 * {"op": "mtom", "endpoint": URL, "soap12": bool, "data": base64} -> {"data": base64 of the reply's d:text}.
 */
final class Mtom {
    static final String DEMO = "urn:wsgate:demo";

    /** The request: d:echo with one d:text of octets. */
    @XmlRootElement(name = "echo", namespace = DEMO)
    @XmlAccessorType(XmlAccessType.FIELD)
    public static final class Echo {
        @XmlElement(namespace = DEMO)
        public byte[] text;
    }

    /** The demo backend's reply: d:echoResponse with the same d:text. */
    @XmlRootElement(name = "echoResponse", namespace = DEMO)
    @XmlAccessorType(XmlAccessType.FIELD)
    public static final class EchoResponse {
        @XmlElement(namespace = DEMO)
        public byte[] text;
    }

    private final JsonObject req;

    Mtom(JsonObject req) {
        this.req = req;
    }

    JsonObject run() throws Exception {
        if (req.has("tls_trust")) {
            HttpsURLConnection.setDefaultSSLSocketFactory(Call.sslContext(req).getSocketFactory());
        }
        QName port = new QName(DEMO, "MtomPort");
        Service service = Service.create(new QName(DEMO, "MtomService"));
        boolean soap12 = req.has("soap12") && req.get("soap12").getAsBoolean();
        String binding = soap12 ? SOAPBinding.SOAP12HTTP_MTOM_BINDING : SOAPBinding.SOAP11HTTP_MTOM_BINDING;
        service.addPort(port, binding, req.get("endpoint").getAsString());
        JAXBContext jaxb = JAXBContext.newInstance(Echo.class, EchoResponse.class);
        Dispatch<Object> dispatch = service.createDispatch(port, jaxb, Service.Mode.PAYLOAD, new MTOMFeature(true, 0));
        Echo echo = new Echo();
        echo.text = Base64.getDecoder().decode(req.get("data").getAsString());
        Object reply = dispatch.invoke(echo);
        if (!(reply instanceof EchoResponse response)) {
            throw new IllegalStateException("reply is not an echoResponse: " + reply);
        }
        JsonObject answer = new JsonObject();
        answer.addProperty("data", Base64.getEncoder().encodeToString(response.text));
        return answer;
    }
}
