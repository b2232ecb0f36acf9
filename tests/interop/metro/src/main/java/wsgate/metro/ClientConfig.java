package wsgate.metro;

import com.google.gson.JsonObject;
import java.io.FileOutputStream;
import java.io.OutputStream;
import java.net.URI;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.KeyStore;
import java.util.ArrayList;
import java.util.List;
import javax.xml.parsers.DocumentBuilderFactory;
import javax.xml.transform.OutputKeys;
import javax.xml.transform.TransformerFactory;
import javax.xml.transform.dom.DOMSource;
import javax.xml.transform.stream.StreamResult;
import org.w3c.dom.Attr;
import org.w3c.dom.Document;
import org.w3c.dom.Element;
import org.w3c.dom.NodeList;

/**
 * Metro's client configuration (META-INF/wsit-client.xml, as NetBeans writes it): the published WSDL's bindings
 * with the client's key store, trust store (the peer alias names the gateway's encryption certificate) and
 * UsernameToken callbacks attached; every security assertion is taken out, so the WS-SecurityPolicy Metro
 * enforces is the published one alone. The key stores are made here, in the call's temporary folder, from PEM.
 */
final class ClientConfig {
    static final String WSDL = "http://schemas.xmlsoap.org/wsdl/";
    static final String XSD = "http://www.w3.org/2001/XMLSchema";
    static final String WSP = "http://www.w3.org/ns/ws-policy";
    static final String WSP_2004 = "http://schemas.xmlsoap.org/ws/2004/09/policy";
    static final String WSU = "http://docs.oasis-open.org/wss/2004/01/oasis-200401-wss-wssecurity-utility-1.0.xsd";
    static final String SC = "http://schemas.sun.com/2006/03/wss/client";
    static final String WSPP = "http://java.sun.com/xml/ns/wsit/policy";
    static final String PASSWORD = "changeit"; // of key stores that live in a temporary folder for one call
    static final String POLICY_ID = "WSGateMetroClientKeys";

    private ClientConfig() {
    }

    static void write(Path dir, JsonObject req) throws Exception {
        String wsdl = req.get("wsdl").getAsString();
        DocumentBuilderFactory dbf = DocumentBuilderFactory.newInstance();
        dbf.setNamespaceAware(true);
        Document doc = dbf.newDocumentBuilder().parse(wsdl);
        Element root = doc.getDocumentElement();
        strip(root);
        absolute(root, URI.create(wsdl));
        root.insertBefore(policy(doc, dir, req), root.getFirstChild());
        NodeList bindings = root.getElementsByTagNameNS(WSDL, "binding");
        for (int i = 0; i < bindings.getLength(); i++) {
            Element binding = (Element) bindings.item(i);
            Element ref = doc.createElementNS(WSP, "wsp:PolicyReference");
            ref.setAttribute("URI", "#" + POLICY_ID);
            binding.insertBefore(ref, binding.getFirstChild());
        }
        Path meta = Files.createDirectories(dir.resolve("META-INF"));
        var transformer = TransformerFactory.newInstance().newTransformer();
        transformer.setOutputProperty(OutputKeys.INDENT, "yes");
        transformer.transform(new DOMSource(doc), new StreamResult(meta.resolve("wsit-client.xml").toFile()));
    }

    private static Element policy(Document doc, Path dir, JsonObject req) throws Exception {
        Element policy = doc.createElementNS(WSP, "wsp:Policy");
        policy.setAttributeNS(WSU, "wsu:Id", POLICY_ID);
        Element all = doc.createElementNS(WSP, "wsp:All");
        Element one = doc.createElementNS(WSP, "wsp:ExactlyOne");
        one.appendChild(all);
        policy.appendChild(one);
        if (req.has("key")) {
            Path ks = dir.resolve("client.p12");
            store(Pem.keyStore("client", req.get("key").getAsString(), req.get("cert").getAsString(),
                PASSWORD.toCharArray()), ks);
            Element keyStore = config(doc, "KeyStore");
            keyStore.setAttribute("location", ks.toString());
            keyStore.setAttribute("type", "PKCS12");
            keyStore.setAttribute("storepass", PASSWORD);
            keyStore.setAttribute("alias", "client");
            all.appendChild(keyStore);
        }
        if (req.has("trust")) {
            List<String> anchors = new ArrayList<>();
            req.getAsJsonArray("trust").forEach(a -> anchors.add(a.getAsString()));
            Path ts = dir.resolve("trust.p12");
            store(Pem.trustStore(anchors), ts);
            Element trustStore = config(doc, "TrustStore");
            trustStore.setAttribute("location", ts.toString());
            trustStore.setAttribute("type", "PKCS12");
            trustStore.setAttribute("storepass", PASSWORD);
            if (req.has("peer")) {
                trustStore.setAttribute("peeralias", req.get("peer").getAsString());
            }
            all.appendChild(trustStore);
        }
        if (req.has("username") || req.has("assertion")) {
            Element callbacks = config(doc, "CallbackHandlerConfiguration");
            if (req.has("username")) {
                callbacks.appendChild(callback(doc, "usernameHandler", req.get("username").getAsString()));
                callbacks.appendChild(callback(doc, "passwordHandler", req.get("password").getAsString()));
            }
            if (req.has("assertion")) { // Metro asks SamlHandler for the assertion to send (SAMLCallback)
                Element saml = doc.createElementNS(SC, "sc:CallbackHandler");
                saml.setAttribute("name", "samlHandler");
                saml.setAttribute("classname", SamlHandler.class.getName());
                callbacks.appendChild(saml);
            }
            all.appendChild(callbacks);
        }
        return policy;
    }

    private static Element config(Document doc, String local) {
        Element el = doc.createElementNS(SC, "sc:" + local);
        el.setAttributeNS(WSPP, "wspp:visibility", "private");
        return el;
    }

    private static Element callback(Document doc, String name, String value) {
        Element el = doc.createElementNS(SC, "sc:CallbackHandler");
        el.setAttribute("name", name);
        el.setAttribute("default", value);
        return el;
    }

    private static void store(KeyStore ks, Path path) throws Exception {
        try (OutputStream out = new FileOutputStream(path.toFile())) {
            ks.store(out, PASSWORD.toCharArray());
        }
    }

    /** Every WS-Policy element and PolicyURIs attribute (both WS-Policy versions). */
    private static void strip(Element root) {
        for (String ns : new String[] {WSP, WSP_2004}) {
            NodeList found = root.getElementsByTagNameNS(ns, "*");
            List<Element> all = new ArrayList<>();
            for (int i = 0; i < found.getLength(); i++) {
                all.add((Element) found.item(i));
            }
            for (Element el : all) {
                if (el.getParentNode() != null) {
                    el.getParentNode().removeChild(el);
                }
            }
            NodeList every = root.getElementsByTagNameNS("*", "*");
            for (int i = 0; i < every.getLength(); i++) {
                Element el = (Element) every.item(i);
                Attr uris = el.getAttributeNodeNS(ns, "PolicyURIs");
                if (uris != null) {
                    el.removeAttributeNode(uris);
                }
            }
        }
    }

    /** Imports resolved against the published WSDL's URL: the configuration is read from a temporary folder. */
    private static void absolute(Element root, URI base) {
        rebase(root.getElementsByTagNameNS(WSDL, "import"), "location", base);
        rebase(root.getElementsByTagNameNS(XSD, "import"), "schemaLocation", base);
        rebase(root.getElementsByTagNameNS(XSD, "include"), "schemaLocation", base);
    }

    private static void rebase(NodeList elements, String attribute, URI base) {
        for (int i = 0; i < elements.getLength(); i++) {
            Element el = (Element) elements.item(i);
            if (el.hasAttribute(attribute)) {
                el.setAttribute(attribute, base.resolve(el.getAttribute(attribute)).toString());
            }
        }
    }
}
