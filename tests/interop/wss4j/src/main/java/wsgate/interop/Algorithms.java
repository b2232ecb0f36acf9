package wsgate.interop;

import java.util.Map;
import org.apache.wss4j.dom.WSConstants;

/** The policy's algorithm names (gateway/policy.py) as WSS4J's URIs and constants. */
final class Algorithms {
    private static final Map<String, String> SIGNATURE = Map.of(
        "rsa-sha256", WSConstants.RSA_SHA256, "rsa-sha1", WSConstants.RSA_SHA1,
        "hmac-sha256", WSConstants.HMAC_SHA256, "hmac-sha1", WSConstants.HMAC_SHA1);
    private static final Map<String, String> DIGEST = Map.of("sha256", WSConstants.SHA256, "sha1", WSConstants.SHA1);
    private static final Map<String, String> DATA = Map.of(
        "aes256-gcm", WSConstants.AES_256_GCM, "aes128-gcm", WSConstants.AES_128_GCM,
        "aes256-cbc", WSConstants.AES_256, "aes128-cbc", WSConstants.AES_128);
    private static final Map<String, String> TRANSPORT = Map.of(
        "rsa-oaep-mgf1p", WSConstants.KEYTRANSPORT_RSAOAEP, "rsa-oaep", WSConstants.KEYTRANSPORT_RSAOAEP_XENC11,
        "rsa-1_5", WSConstants.KEYTRANSPORT_RSA15);
    private static final Map<String, Integer> KEY_IDENTIFIER = Map.of(
        "bst", WSConstants.BST_DIRECT_REFERENCE, "ski", WSConstants.SKI_KEY_IDENTIFIER,
        "issuer_serial", WSConstants.ISSUER_SERIAL, "thumbprint", WSConstants.THUMBPRINT_IDENTIFIER,
        "x509", WSConstants.X509_KEY_IDENTIFIER);

    private Algorithms() {
    }

    static String signature(String name) {
        return get(SIGNATURE, name, "signature algorithm");
    }

    static String digest(String name) {
        return get(DIGEST, name, "digest");
    }

    static String data(String name) {
        return get(DATA, name, "data algorithm");
    }

    static String transport(String name) {
        return get(TRANSPORT, name, "key transport");
    }

    static int keyIdentifier(String name) {
        return get(KEY_IDENTIFIER, name, "key identifier type");
    }

    private static <T> T get(Map<String, T> map, String name, String what) {
        T got = map.get(name);
        if (got == null) {
            throw new IllegalArgumentException("unknown " + what + " " + name);
        }
        return got;
    }
}
