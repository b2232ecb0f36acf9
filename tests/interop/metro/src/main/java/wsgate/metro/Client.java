package wsgate.metro;

import com.google.gson.Gson;
import com.google.gson.JsonObject;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.io.PrintWriter;
import java.io.StringWriter;
import java.nio.charset.StandardCharsets;

/**
 * Eclipse Metro 4.0.4 as a client of the gateway, behind JSON lines: one request object per line on stdin, one
 * answer per line on stdout. {"op": "ping" | "call" | "mtom", ...} -> {"ok": true, ...} or
 * {"ok": false, "error": "..."} (Metro's own error text and its causes). One process serves a whole pytest
 * session; see Call and Mtom.
 */
public final class Client {
    private static final Gson GSON = new Gson();

    private Client() {
    }

    public static void main(String[] args) throws Exception {
        PrintStream out = new PrintStream(System.out, true, StandardCharsets.UTF_8);
        System.setOut(System.err); // nothing but answers on the protocol stream
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
                    case "call" -> new Call(req).run();
                    case "mtom" -> new Mtom(req).run();
                    default -> throw new IllegalArgumentException("unknown op " + op);
                };
                answer.addProperty("ok", true);
            } catch (Exception e) {
                answer = new JsonObject();
                answer.addProperty("ok", false);
                answer.addProperty("error", describe(e));
                StringWriter trace = new StringWriter();
                e.printStackTrace(new PrintWriter(trace));
                answer.addProperty("trace", trace.toString());
            }
            out.println(GSON.toJson(answer));
        }
    }

    /** The exception and each of its causes, one line: Metro wraps the reason a few levels down. */
    static String describe(Throwable e) {
        StringBuilder text = new StringBuilder(e.toString());
        for (Throwable c = e.getCause(); c != null && c != c.getCause(); c = c.getCause()) {
            text.append(" <- ").append(c);
        }
        return text.toString();
    }
}
