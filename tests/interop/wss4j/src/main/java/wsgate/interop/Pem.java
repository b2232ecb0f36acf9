package wsgate.interop;

import java.io.ByteArrayInputStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.security.KeyFactory;
import java.security.KeyStore;
import java.security.PrivateKey;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;
import java.security.cert.X509Certificate;
import java.security.spec.PKCS8EncodedKeySpec;
import java.util.Base64;
import java.util.HashMap;
import java.util.Map;
import org.apache.wss4j.common.crypto.Merlin;

/** The demo PKI's PEM files (certs/pki.py: PKCS#8 keys, X.509 certificates) as WSS4J Merlin crypto objects. */
final class Pem {
    static final String KEY_ALIAS = "key";
    private static final Map<String, Merlin> CRYPTO = new HashMap<>();

    private Pem() {
    }

    static X509Certificate certificate(String path) throws Exception {
        byte[] pem = Files.readAllBytes(Path.of(path));
        return (X509Certificate) CertificateFactory.getInstance("X.509")
            .generateCertificate(new ByteArrayInputStream(pem));
    }

    static PrivateKey privateKey(String path) throws Exception {
        String pem = Files.readString(Path.of(path));
        String b64 = pem.replaceAll("-----(BEGIN|END) PRIVATE KEY-----", "").replaceAll("\\s", "");
        return KeyFactory.getInstance("RSA").generatePrivate(new PKCS8EncodedKeySpec(Base64.getDecoder().decode(b64)));
    }

    /**
     * A Merlin with an optional private key (alias KEY_ALIAS) and the given trust anchors. Kept per set of files (and
     * their modification times): a WSS4J service loads its Crypto once, and the bench must not time PEM parsing.
     */
    static Merlin crypto(String keyPath, String certPath, String... anchors) throws Exception {
        StringBuilder id = new StringBuilder();
        for (String path : concat(keyPath, certPath, anchors)) {
            id.append(path).append('@').append(path == null ? 0 : Files.getLastModifiedTime(Path.of(path)).toMillis())
                .append('|');
        }
        Merlin cached = CRYPTO.get(id.toString());
        if (cached == null) {
            cached = load(keyPath, certPath, anchors);
            CRYPTO.put(id.toString(), cached);
        }
        return cached;
    }

    private static String[] concat(String keyPath, String certPath, String[] anchors) {
        String[] all = new String[anchors.length + 2];
        all[0] = keyPath;
        all[1] = certPath;
        System.arraycopy(anchors, 0, all, 2, anchors.length);
        return all;
    }

    private static Merlin load(String keyPath, String certPath, String... anchors) throws Exception {
        Merlin merlin = new Merlin();
        KeyStore ks = KeyStore.getInstance("PKCS12");
        ks.load(null, null);
        if (keyPath != null) {
            ks.setKeyEntry(KEY_ALIAS, privateKey(keyPath), Secrets.STORE_PASSWORD,
                new Certificate[] {certificate(certPath)});
        }
        merlin.setKeyStore(ks);
        KeyStore ts = KeyStore.getInstance("PKCS12");
        ts.load(null, null);
        int i = 0;
        for (String anchor : anchors) {
            ts.setCertificateEntry("anchor" + i++, certificate(anchor));
        }
        merlin.setTrustStore(ts);
        return merlin;
    }
}
