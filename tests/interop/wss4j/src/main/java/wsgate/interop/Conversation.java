package wsgate.interop;

import com.google.gson.JsonObject;
import java.security.MessageDigest;
import java.util.Base64;
import java.util.HexFormat;
import org.apache.wss4j.common.derivedKey.P_SHA1;
import org.apache.xml.security.stax.ext.XMLSecurityConstants;

/**
 * The STS side of WS-SecureConversation for the partner service (tests/support/partner.py), its keys kept in this
 * JVM: `issue` {"identifier", "entropy" (the requestor's, base64), "key_bits"} makes the context's secret as
 * WS-Trust 1.3's ComputedKey P_SHA1 says (WSS4J's P_SHA1 of the requestor's entropy and fresh issuer entropy) ->
 * {"entropy": the issuer's, base64, "secret_sha256"}; `cancel` {"identifier"} forgets the context. The RST/RSTR
 * structure is the Python partner's; derived keys of the context then serve `secure` ("sct" steps) and `verify`.
 */
final class Conversation {
    private final JsonObject req;
    private final Secrets secrets;

    Conversation(JsonObject req, Secrets secrets) {
        this.req = req;
        this.secrets = secrets;
    }

    JsonObject issue() throws Exception {
        byte[] requestor = Base64.getDecoder().decode(req.get("entropy").getAsString());
        int size = req.get("key_bits").getAsInt() / 8;
        byte[] issuer = XMLSecurityConstants.generateBytes(size); // the source of WSS4J's own nonces
        byte[] secret = new P_SHA1().createKey(requestor, issuer, 0, size);
        secrets.put(req.get("identifier").getAsString(), secret);
        JsonObject answer = new JsonObject();
        answer.addProperty("entropy", Base64.getEncoder().encodeToString(issuer));
        // Which key it was, for a test to compare with the gateway's (the key itself stays here).
        answer.addProperty("secret_sha256",
            HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(secret)));
        return answer;
    }

    JsonObject cancel() {
        secrets.remove(req.get("identifier").getAsString());
        return new JsonObject();
    }
}
