# Stand-in for envoyproxy/ratelimit:<commit>: the service `make ratelimit` built on this machine from the Go module
# proxy at the commit gateway/tools/ratelimit/go.mod pins (the official image builds the same commit's service_cmd
# on Alpine). The official contract kept: /bin/ratelimit, run by the command (no entrypoint), settings from the
# environment only, root by default, CA certificates, a wget for health checks (busybox's there, Debian's here).
FROM wsgate-standin/bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*
COPY ratelimit /bin/ratelimit
