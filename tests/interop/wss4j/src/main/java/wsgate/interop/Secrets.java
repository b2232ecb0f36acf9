package wsgate.interop;

import java.util.Base64;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import javax.security.auth.callback.Callback;
import javax.security.auth.callback.CallbackHandler;
import javax.security.auth.callback.UnsupportedCallbackException;
import org.apache.wss4j.common.ext.WSPasswordCallback;

/**
 * WSS4J's CallbackHandler: secrets by identifier (pre-shared HMAC keys by name, EncryptedKeys we sent by their
 * EncryptedKeySHA1 and wsu:Id, security contexts by Identifier), UsernameToken passwords, and the one password of
 * the in-memory key stores. Secrets registered by a `secure` stay known for the process's life (a test session).
 */
final class Secrets implements CallbackHandler {
    static final char[] STORE_PASSWORD = "wss4j-harness".toCharArray();

    private final Map<String, byte[]> keys = new ConcurrentHashMap<>();
    private final Map<String, String> passwords = new ConcurrentHashMap<>();

    void put(String identifier, byte[] secret) {
        keys.put(identifier, secret);
    }

    void remove(String identifier) {
        keys.remove(identifier);
    }

    byte[] get(String identifier) {
        byte[] key = keys.get(identifier);
        if (key == null) {
            throw new IllegalArgumentException("no secret " + identifier);
        }
        return key;
    }

    void putBase64(Map<String, String> secrets) {
        secrets.forEach((id, b64) -> keys.put(id, Base64.getDecoder().decode(b64)));
    }

    void password(String user, String password) {
        passwords.put(user, password);
    }

    @Override
    public void handle(Callback[] callbacks) throws UnsupportedCallbackException {
        for (Callback callback : callbacks) {
            if (!(callback instanceof WSPasswordCallback pc)) {
                throw new UnsupportedCallbackException(callback);
            }
            String id = pc.getIdentifier();
            switch (pc.getUsage()) {
                case WSPasswordCallback.SECRET_KEY, WSPasswordCallback.SECURITY_CONTEXT_TOKEN -> {
                    byte[] key = id == null ? null : keys.get(id.startsWith("#") ? id.substring(1) : id);
                    if (key != null) {
                        pc.setKey(key);
                    }
                }
                case WSPasswordCallback.USERNAME_TOKEN -> pc.setPassword(passwords.get(id));
                case WSPasswordCallback.DECRYPT, WSPasswordCallback.SIGNATURE ->
                    pc.setPassword(new String(STORE_PASSWORD));
                default -> {
                    // CUSTOM_TOKEN and the rest: nothing to give
                }
            }
        }
    }
}
