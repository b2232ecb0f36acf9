package wsgate.interop;

import com.google.gson.JsonArray;
import com.google.gson.JsonObject;
import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;

/**
 * `bench`: WSS4J's secure + verify of one message shape, timed in this thread's CPU time, so that the engine's
 * figures are divided by WSS4J's measured in the same run on the same machine (loadtest/engine_cpu.py), never by a
 * stored one. {"secure": a `secure` request, "verify": a `verify` request without "xml", "warmup_s", "round_s",
 * "rounds"} -> {"us": [CPU us per secure + verify, one per round], "ops": [ops per round]}. Each op secures a
 * fresh copy of the plain envelope (WSS4J makes a new Timestamp, nonces and keys each time) and verifies it.
 */
final class Bench {
    private static final ThreadMXBean THREADS = ManagementFactory.getThreadMXBean();

    private final JsonObject req;
    private final Secrets secrets;

    Bench(JsonObject req, Secrets secrets) {
        this.req = req;
        this.secrets = secrets;
    }

    JsonObject run() throws Exception {
        JsonObject secure = req.getAsJsonObject("secure");
        JsonObject verify = req.getAsJsonObject("verify").deepCopy();
        // JIT first: WSS4J in a server is warm; a cold JVM would flatter the engine.
        timed(secure, verify, seconds("warmup_s", 5));
        int rounds = req.has("rounds") ? req.get("rounds").getAsInt() : 3;
        double roundSeconds = seconds("round_s", 2);
        JsonArray us = new JsonArray();
        JsonArray ops = new JsonArray();
        for (int i = 0; i < rounds; i++) {
            long[] r = timed(secure, verify, roundSeconds);
            us.add(r[0] / 1000.0 / r[1]);
            ops.add(r[1]);
        }
        JsonObject answer = new JsonObject();
        answer.add("us", us);
        answer.add("ops", ops);
        return answer;
    }

    /** {CPU ns, ops} of secure + verify repeated for `seconds` of wall time (at least one op). */
    private long[] timed(JsonObject secure, JsonObject verify, double seconds) throws Exception {
        long end = System.nanoTime() + (long) (seconds * 1e9);
        long cpu0 = THREADS.getCurrentThreadCpuTime();
        long n = 0;
        do {
            JsonObject secured = new Secure(secure, secrets).run();
            verify.addProperty("xml", secured.get("xml").getAsString());
            new Verify(verify, secrets).run();
            n++;
        } while (System.nanoTime() < end);
        return new long[] {THREADS.getCurrentThreadCpuTime() - cpu0, n};
    }

    private double seconds(String name, double fallback) {
        return req.has(name) ? req.get(name).getAsDouble() : fallback;
    }
}
