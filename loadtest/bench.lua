-- wrk script for loadtest/bench.py: POSTs pre-generated bodies, each exactly once unless told to cycle.
--
--   wrk -t2 -c16 -d10s -s loadtest/bench.lua URL -- PATH CONTENT_TYPE BODIES MODE
--
-- BODIES is a file prefix: thread N reads BODIES.N, a sequence of records "<length>\n<bytes>". MODE "once": a
-- thread that has sent all its bodies stops (and reports it) rather than send one twice, so a route with replay
-- detection never sees a replay; MODE "cycle": bodies are reused (plain routes, where repeats are harmless).
-- done() prints one "WSGATE key=value ..." line that bench.py parses.

local threads = {}
local thread_count = 0

function setup(thread)
   thread:set("id", thread_count)
   thread_count = thread_count + 1
   table.insert(threads, thread)
end

function init(args)
   path = args[1]
   headers = { ["Content-Type"] = args[2] }
   once = args[4] == "once"
   bodies = {}
   local f = assert(io.open(args[3] .. "." .. id, "rb"))
   while true do
      local len = f:read("*l")
      if not len then break end
      bodies[#bodies + 1] = f:read(tonumber(len))
   end
   f:close()
   count = #bodies
   sent = 0
   exhausted = 0
end

function request()
   if sent >= count then
      if once then
         -- Never send a body twice: stop this thread; the request returned here goes to no route (404).
         exhausted = 1
         wrk.thread:stop()
         return wrk.format("GET", "/__wsgate_bench_pool_exhausted")
      end
      sent = 0
   end
   sent = sent + 1
   return wrk.format("POST", path, headers, bodies[sent])
end

function done(summary, latency, requests)
   local exhausted_threads, bodies_sent, bodies_total = 0, 0, 0
   for _, t in ipairs(threads) do
      exhausted_threads = exhausted_threads + t:get("exhausted")
      bodies_sent = bodies_sent + t:get("sent")
      bodies_total = bodies_total + t:get("count")
   end
   local e = summary.errors
   io.write(string.format(
      "WSGATE requests=%d duration_us=%d bytes=%d connect=%d read=%d write=%d status=%d timeout=%d " ..
      "p50_us=%d p90_us=%d p99_us=%d max_us=%d exhausted_threads=%d bodies_sent=%d bodies=%d\n",
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
      exhausted_threads, bodies_sent, bodies_total))
end
