package wsgate.interop;

import com.google.gson.Gson;
import com.google.gson.JsonObject;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.io.PrintWriter;
import java.io.StringWriter;
import java.nio.charset.StandardCharsets;
import org.apache.wss4j.common.ext.WSSecurityException;
import org.apache.wss4j.dom.engine.WSSConfig;

/**
 * A real, unmodified Apache WSS4J 4.0.1 (DOM API) behind JSON lines: one request object per line on stdin, one
 * answer object per line on stdout. {"op": "secure" | "verify" | "sc_issue" | "sc_cancel" |
 * "bench" | "ping", ...} -> {"ok": true, ...} or
 * {"ok": false, "error": "..."} (WSS4J's own error text). One process serves a whole pytest session.
 */
public final class Harness {
    private static final Gson GSON = new Gson();

    private Harness() {
    }

    public static void main(String[] args) throws Exception {
        PrintStream out = new PrintStream(System.out, true, StandardCharsets.UTF_8);
        System.setOut(System.err); // nothing but answers on the protocol stream
        WSSConfig.init();
        Secrets secrets = new Secrets();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isBlank()) {
                continue;
            }
            JsonObject answer;
            try {
                JsonObject req = GSON.fromJson(line, JsonObject.class);
                String op = req.get("op").getAsString();
                answer = switch (op) {
                    case "ping" -> new JsonObject();
                    case "secure" -> new Secure(req, secrets).run();
                    case "verify" -> new Verify(req, secrets).run();
                    case "bench" -> new Bench(req, secrets).run();
                    case "sc_issue" -> new Conversation(req, secrets).issue();
                    case "sc_cancel" -> new Conversation(req, secrets).cancel();
                    default -> throw new IllegalArgumentException("unknown op " + op);
                };
                answer.addProperty("ok", true);
            } catch (WSSecurityException e) {
                answer = failure(e, e.getMessage() + describeCause(e));
            } catch (Exception e) {
                answer = failure(e, e.toString());
            }
            out.println(GSON.toJson(answer));
        }
    }

    private static String describeCause(WSSecurityException e) {
        Throwable cause = e.getCause();
        return cause == null || cause.getMessage() == null ? "" : " (" + cause.getMessage() + ")";
    }

    private static JsonObject failure(Exception e, String message) {
        JsonObject answer = new JsonObject();
        answer.addProperty("ok", false);
        answer.addProperty("error", message);
        if (!(e instanceof WSSecurityException)) {
            StringWriter trace = new StringWriter();
            e.printStackTrace(new PrintWriter(trace));
            answer.addProperty("trace", trace.toString());
        }
        return answer;
    }
}
