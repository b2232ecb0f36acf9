package wsgate.metro;

import com.sun.xml.wss.impl.callback.SAMLCallback;
import java.io.StringReader;
import javax.security.auth.callback.Callback;
import javax.security.auth.callback.CallbackHandler;
import javax.security.auth.callback.UnsupportedCallbackException;
import javax.xml.parsers.DocumentBuilderFactory;
import org.xml.sax.InputSource;

/**
 * Metro's SAML callback (the "samlHandler" of the client configuration): Metro asks it for the assertion to send,
 * sender-vouches or holder-of-key as the policy's SamlToken says, and puts what it gets in the Security header.
 * The assertion is the call's "assertion" (signed by the test's issuer); calls are serialized, so one at a time.
 */
public final class SamlHandler implements CallbackHandler {
    static volatile String assertion;

    @Override
    public void handle(Callback[] callbacks) throws UnsupportedCallbackException {
        for (Callback callback : callbacks) {
            if (!(callback instanceof SAMLCallback saml)) {
                throw new UnsupportedCallbackException(callback);
            }
            try {
                DocumentBuilderFactory dbf = DocumentBuilderFactory.newInstance();
                dbf.setNamespaceAware(true);
                dbf.setFeature("http://apache.org/xml/features/disallow-doctype-decl", true);
                var doc = dbf.newDocumentBuilder().parse(new InputSource(new StringReader(assertion)));
                saml.setAssertionElement(doc.getDocumentElement());
            } catch (Exception e) {
                throw new IllegalStateException("the call's assertion: " + e, e);
            }
        }
    }
}
