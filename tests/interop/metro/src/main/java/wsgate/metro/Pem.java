package wsgate.metro;

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
import java.util.List;

/** The demo PKI's PEM files (certs/pki.py: PKCS#8 keys, X.509 certificates) as Java key stores. */
final class Pem {
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

    static KeyStore keyStore(String alias, String key, String cert, char[] password) throws Exception {
        KeyStore ks = KeyStore.getInstance("PKCS12");
        ks.load(null, null);
        ks.setKeyEntry(alias, privateKey(key), password, new Certificate[] {certificate(cert)});
        return ks;
    }

    /** Trusted certificates, aliased by their file name without ".pem". */
    static KeyStore trustStore(List<String> certs) throws Exception {
        KeyStore ts = KeyStore.getInstance("PKCS12");
        ts.load(null, null);
        for (String cert : certs) {
            ts.setCertificateEntry(Path.of(cert).getFileName().toString().replace(".pem", ""), certificate(cert));
        }
        return ts;
    }
}
