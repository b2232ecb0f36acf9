package wsgate.interop;

import com.google.gson.JsonArray;
import com.google.gson.JsonElement;
import com.google.gson.JsonObject;
import java.security.MessageDigest;
import java.util.ArrayList;
import java.util.Base64;
import java.util.HashSet;
import java.util.HexFormat;
import java.util.List;
import java.util.Set;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import javax.crypto.SecretKey;
import org.apache.wss4j.common.WSEncryptionPart;
import org.apache.wss4j.common.crypto.Crypto;
import org.apache.wss4j.common.derivedKey.ConversationConstants;
import org.apache.wss4j.common.util.KeyUtils;
import org.apache.wss4j.dom.WSConstants;
import org.apache.wss4j.dom.engine.WSSConfig;
import org.apache.wss4j.dom.message.WSSecDKEncrypt;
import org.apache.wss4j.dom.message.WSSecDKSign;
import org.apache.wss4j.dom.message.WSSecDerivedKeyBase;
import org.apache.wss4j.dom.message.WSSecEncrypt;
import org.apache.wss4j.dom.message.WSSecEncryptedKey;
import org.apache.wss4j.dom.message.WSSecHeader;
import org.apache.wss4j.dom.message.WSSecSecurityContextToken;
import org.apache.wss4j.dom.message.WSSecSignature;
import org.apache.wss4j.dom.message.WSSecTimestamp;
import org.apache.wss4j.dom.message.WSSecUsernameToken;
import org.w3c.dom.Document;
import org.w3c.dom.Element;
import org.w3c.dom.Node;

/**
 * `secure`: WSS4J's WSSec* builders applied to a plain envelope, step by step, as CXF's binding handlers call them.
 *
 * <p>{"xml": envelope, "layout": "prepend" | "append", "steps": [...]}. "prepend" keeps WSS4J's own placement
 * (each builder prepends, the layout of WSS4J's WSHandler actions); "append" moves what each step adds to the end
 * of the Security header (tokens before their use, as CXF's Strict layout), leaving EncryptedData where it
 * replaced the element it encrypts. Steps: timestamp, username, encrypted_key, sct, sign, encrypt (tests/support/wss4j.py
 * builds them).
 */
final class Secure {
    private static final Pattern PART = Pattern.compile("\\{(\\w*)\\}\\{([^}]*)\\}([\\w.-]+)");

    private final JsonObject req;
    private final Secrets secrets;
    private final Document doc;
    private final WSSecHeader header;
    private final boolean append;
    private final JsonObject answer = new JsonObject();
    private final Attachments attachments;
    private SecretKey sessionKey;
    private WSSecEncryptedKey encryptedKey;
    private String sctId;
    private String sctIdentifier;
    private byte[] sctSecret;

    Secure(JsonObject req, Secrets secrets) throws Exception {
        this.req = req;
        this.secrets = secrets;
        this.doc = Xml.parse(req.get("xml").getAsString());
        this.header = new WSSecHeader(doc);
        this.header.setMustUnderstand(true);
        this.header.insertSecurityHeader();
        this.append = "append".equals(str(req, "layout", "prepend"));
        this.attachments = new Attachments(req.getAsJsonArray("attachments"));
    }

    JsonObject run() throws Exception {
        for (JsonElement s : req.getAsJsonArray("steps")) {
            JsonObject step = s.getAsJsonObject();
            Set<Node> before = children();
            switch (step.get("do").getAsString()) {
                case "timestamp" -> timestamp(step);
                case "username" -> username(step);
                case "encrypted_key" -> encryptedKey(step);
                case "sct" -> sct(step);
                case "sign" -> sign(step);
                case "encrypt" -> encrypt(step);
                default -> throw new IllegalArgumentException("unknown step " + step.get("do"));
            }
            if (append) {
                moveNewToEnd(before);
            }
        }
        answer.addProperty("xml", Xml.serialize(doc));
        JsonArray parts = attachments.toJson();
        if (!parts.isEmpty()) {
            answer.add("attachments", parts);
        }
        return answer;
    }

    private void timestamp(JsonObject step) {
        WSSecTimestamp ts = new WSSecTimestamp(header);
        ts.setTimeToLive(step.has("ttl") ? step.get("ttl").getAsInt() : 300);
        ts.build();
    }

    private void username(JsonObject step) {
        WSSecUsernameToken ut = new WSSecUsernameToken(header);
        boolean digest = !step.has("digest") || step.get("digest").getAsBoolean();
        ut.setPasswordType(digest ? WSConstants.PASSWORD_DIGEST : WSConstants.PASSWORD_TEXT);
        ut.setUserInfo(step.get("user").getAsString(), step.get("password").getAsString());
        ut.addNonce();
        ut.addCreated();
        ut.build();
        answer.addProperty("username_token_id", ut.getId());
    }

    /** A fresh session key sent to the gateway in an EncryptedKey (the symmetric binding's protection token). */
    private void encryptedKey(JsonObject step) throws Exception {
        String algorithm = Algorithms.data(str(step, "algorithm", "aes256-gcm"));
        sessionKey = KeyUtils.getKeyGenerator(algorithm).generateKey();
        encryptedKey = new WSSecEncryptedKey(header);
        encryptedKey.setUseThisCert(Pem.certificate(step.get("cert").getAsString()));
        encryptedKey.setKeyIdentifierType(Algorithms.keyIdentifier(str(step, "id_type", "ski")));
        encryptedKey.setKeyEncAlgo(Algorithms.transport(str(step, "transport", "rsa-oaep-mgf1p")));
        encryptedKey.prepare(Pem.crypto(null, null), sessionKey);
        encryptedKey.prependToHeader();
        byte[] raw = sessionKey.getEncoded();
        secrets.put(encryptedKey.getId(), raw);
        secrets.put(encryptedKey.getEncryptedKeySHA1(), raw);
        answer.addProperty("encrypted_key_sha1", encryptedKey.getEncryptedKeySHA1());
        // Which key it was, for the test to recognize it in the reply (the key itself stays in the JVM).
        answer.addProperty("session_key_sha256",
            HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(raw)));
    }

    /** The context (its secret given, or one `sc_issue` made) and its SecurityContextToken in the header (CXF's
     * IncludeToken AlwaysToRecipient) unless "in_header": false. */
    private void sct(JsonObject step) throws Exception {
        sctIdentifier = step.get("identifier").getAsString();
        if (step.has("secret")) {
            sctSecret = Base64.getDecoder().decode(step.get("secret").getAsString());
            secrets.put(sctIdentifier, sctSecret);
        } else {
            // A context this JVM issued (Conversation): its secret never left. "key": another context's secret
            // under this one's name (a partner deriving from the wrong context).
            sctSecret = secrets.get(str(step, "key", sctIdentifier));
        }
        if (step.has("in_header") && !step.get("in_header").getAsBoolean()) {
            return;
        }
        WSSecSecurityContextToken sct = new WSSecSecurityContextToken(header, WSSConfig.getNewInstance());
        sct.setWscVersion(ConversationConstants.VERSION_05_12);
        sct.setIdentifier(sctIdentifier);
        sct.prepare(null);
        sct.prependSCTElementToHeader();
        sctId = sct.getSctId();
    }

    /** A derived key from the context: the SecurityContextToken in the header, else its identifier. */
    private void fromContext(WSSecDerivedKeyBase dk) {
        dk.setWscVersion(ConversationConstants.VERSION_05_12);
        dk.setCustomValueType(WSConstants.WSC_SCT_05_12);
        if (sctId != null) {
            dk.setTokenIdentifier(sctId);
        } else {
            dk.setTokenIdDirectId(true);
            dk.setTokenIdentifier(sctIdentifier);
        }
    }

    private void sign(JsonObject step) throws Exception {
        String with = step.get("with").getAsString();
        List<WSEncryptionPart> parts = parts(step);
        String digest = Algorithms.digest(str(step, "digest", "sha256"));
        if ("sct".equals(with)) {
            WSSecDKSign dk = new WSSecDKSign(header);
            fromContext(dk);
            dk.setSignatureAlgorithm(Algorithms.signature(str(step, "algorithm", "hmac-sha256")));
            dk.setDigestAlgorithm(digest);
            dk.setDerivedKeyLength(32);
            dk.getParts().addAll(parts);
            dk.build(sctSecret);
            return;
        }
        WSSecSignature sig = new WSSecSignature(header);
        sig.setAttachmentCallbackHandler(attachments);
        sig.setDigestAlgo(digest);
        sig.getParts().addAll(parts);
        Crypto crypto = null;
        switch (with) {
            case "x509" -> {
                sig.setSignatureAlgorithm(Algorithms.signature(str(step, "algorithm", "rsa-sha256")));
                sig.setUserInfo(Pem.KEY_ALIAS, new String(Secrets.STORE_PASSWORD));
                sig.setKeyIdentifierType(Algorithms.keyIdentifier(str(step, "id_type", "bst")));
                crypto = Pem.crypto(step.get("key").getAsString(), step.get("cert").getAsString());
            }
            case "sct_direct" -> {
                // The context's own key (no sp:RequireDerivedKeys): the SCT in the header, else its Identifier.
                sig.setSignatureAlgorithm(Algorithms.signature(str(step, "algorithm", "hmac-sha256")));
                sig.setSecretKey(sctSecret);
                sig.setCustomTokenValueType(WSConstants.WSC_SCT_05_12);
                sig.setKeyIdentifierType(sctId != null ? WSConstants.CUSTOM_SYMM_SIGNING
                                                       : WSConstants.CUSTOM_SYMM_SIGNING_DIRECT);
                sig.setCustomTokenId(sctId != null ? sctId : sctIdentifier);
            }
            case "psk" -> {
                // WSS4J's form for a key both sides know: a Reference to the key's name, a custom ValueType.
                sig.setSignatureAlgorithm(Algorithms.signature(str(step, "algorithm", "hmac-sha256")));
                sig.setSecretKey(Base64.getDecoder().decode(step.get("secret").getAsString()));
                sig.setKeyIdentifierType(WSConstants.CUSTOM_SYMM_SIGNING);
                sig.setCustomTokenId(step.get("name").getAsString());
                sig.setCustomTokenValueType(str(step, "value_type", "urn:wsgate:pre-shared-key"));
            }
            case "received" -> {
                // The key of a request's EncryptedKey (kept by `verify`), named by its EncryptedKeySHA1: a
                // symmetric-binding service's reply.
                String sha1 = step.get("encrypted_key_sha1").getAsString();
                sig.setSignatureAlgorithm(Algorithms.signature(str(step, "algorithm", "hmac-sha256")));
                sig.setSecretKey(secrets.get(sha1));
                sig.setKeyIdentifierType(WSConstants.ENCRYPTED_KEY_SHA1_IDENTIFIER);
                sig.setEncrKeySha1value(sha1);
            }
            case "encrypted_key" -> {
                sig.setSignatureAlgorithm(Algorithms.signature(str(step, "algorithm", "hmac-sha256")));
                sig.setSecretKey(sessionKey.getEncoded());
                sig.setKeyIdentifierType(WSConstants.CUSTOM_SYMM_SIGNING);
                sig.setCustomTokenId(encryptedKey.getId());
                sig.setCustomTokenValueType(WSConstants.WSS_ENC_KEY_VALUE_TYPE);
            }
            default -> throw new IllegalArgumentException("sign with " + with);
        }
        sig.build(crypto);
        answer.addProperty("signature_id", sig.getId());
    }

    private void encrypt(JsonObject step) throws Exception {
        String with = step.get("with").getAsString();
        WSSecEncrypt enc = new WSSecEncrypt(header);
        enc.setSymmetricEncAlgorithm(Algorithms.data(str(step, "algorithm", "aes256-gcm")));
        enc.setAttachmentCallbackHandler(attachments);
        enc.setStoreBytesInAttachment(Attachments.flag(step, "store_bytes_in_attachment"));
        enc.getParts().addAll(parts(step));
        if ("x509".equals(with)) {
            // WSS4J's encryption action: a fresh key in an EncryptedKey whose ReferenceList names every part.
            enc.setUseThisCert(Pem.certificate(step.get("cert").getAsString()));
            enc.setKeyIdentifierType(Algorithms.keyIdentifier(str(step, "id_type", "ski")));
            enc.setKeyEncAlgo(Algorithms.transport(str(step, "transport", "rsa-oaep-mgf1p")));
            SecretKey key = KeyUtils.getKeyGenerator(enc.getSymmetricEncAlgorithm()).generateKey();
            enc.build(Pem.crypto(null, null), key);
            return;
        }
        if ("sct".equals(with)) {
            // A key derived from the context's secret (CXF's SecureConversation with RequireDerivedKeys).
            WSSecDKEncrypt dk = new WSSecDKEncrypt(header);
            fromContext(dk);
            dk.setSymmetricEncAlgorithm(enc.getSymmetricEncAlgorithm());
            dk.setDerivedKeyLength(32);
            dk.getParts().addAll(enc.getParts());
            Set<Node> before = children();
            dk.build(sctSecret);
            // The ReferenceList goes after the DerivedKeyToken whose key it needs.
            Element sec = header.getSecurityHeaderElement();
            for (Node n = sec.getFirstChild(); n != null; n = n.getNextSibling()) {
                if (!before.contains(n) && "ReferenceList".equals(n.getLocalName())) {
                    sec.removeChild(n);
                    Element dkt = dk.getdktElement();
                    sec.insertBefore(n, dkt.getNextSibling());
                    break;
                }
            }
            return;
        }
        if (!"encrypted_key".equals(with)) {
            throw new IllegalArgumentException("encrypt with " + with);
        }
        // Under the symmetric binding's key: each EncryptedData names the EncryptedKey, the ReferenceList
        // follows the EncryptedKey (CXF's SymmetricBindingHandler).
        enc.setEncryptSymmKey(false);
        enc.setEncKeyId(encryptedKey.getId());
        enc.setCustomReferenceValue(WSConstants.WSS_ENC_KEY_VALUE_TYPE);
        enc.prepare(null, sessionKey);
        Element refs = enc.encrypt(sessionKey);
        Element ek = encryptedKey.getEncryptedKeyElement();
        ek.getParentNode().insertBefore(refs, ek.getNextSibling());
    }

    /** The step's "parts", then "cid:Attachments" (every attachment) with the step's "attachments" modifier:
     * Element (Attachment-Complete: headers too) or Content (Attachment-Content-Only). */
    private List<WSEncryptionPart> parts(JsonObject step) {
        List<WSEncryptionPart> out = new ArrayList<>();
        JsonArray names = step.getAsJsonArray("parts");
        for (JsonElement n : names == null ? new JsonArray() : names) {
            Matcher m = PART.matcher(n.getAsString());
            if (!m.matches()) {
                throw new IllegalArgumentException("part " + n + ": {Element|Content|}{namespace}localName");
            }
            out.add(new WSEncryptionPart(m.group(3), m.group(2), m.group(1).isEmpty() ? "Element" : m.group(1)));
        }
        if (step.has("attachments")) {
            out.add(new WSEncryptionPart("cid:Attachments", step.get("attachments").getAsString()));
        }
        return out;
    }

    private Set<Node> children() {
        Set<Node> out = new HashSet<>();
        for (Node n = header.getSecurityHeaderElement().getFirstChild(); n != null; n = n.getNextSibling()) {
            out.add(n);
        }
        return out;
    }

    /** Append layout: what the step added goes to the end, in order; encrypted parts and lists stay in place. */
    private void moveNewToEnd(Set<Node> before) {
        Element sec = header.getSecurityHeaderElement();
        List<Node> added = new ArrayList<>();
        for (Node n = sec.getFirstChild(); n != null; n = n.getNextSibling()) {
            boolean kept = WSConstants.ENC_NS.equals(n.getNamespaceURI())
                && ("EncryptedData".equals(n.getLocalName()) || "ReferenceList".equals(n.getLocalName()));
            if (!before.contains(n) && !kept) {
                added.add(n);
            }
        }
        added.forEach(sec::appendChild);
    }

    private static String str(JsonObject o, String name, String dflt) {
        return o.has(name) && !o.get(name).isJsonNull() ? o.get(name).getAsString() : dflt;
    }
}
