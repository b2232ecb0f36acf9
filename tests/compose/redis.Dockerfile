# Stand-in for redis:7-alpine: Debian bookworm's redis-server 7.0 on bookworm-slim instead of Alpine's musl build.
# The official contract kept: redis-server and redis-cli on PATH, the redis user (uid 999, gid 1000), WORKDIR and
# VOLUME /data owned by it, the docker-entrypoint.sh that drops root to redis, EXPOSE 6379, CMD redis-server.
FROM wsgate-standin/bookworm-slim
RUN groupadd --system --gid 1000 redis \
 && useradd --system --uid 999 --gid 1000 --home-dir /data --no-create-home --shell /usr/sbin/nologin redis \
 && apt-get update \
 && apt-get install -y --no-install-recommends redis-server redis-tools gosu \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
VOLUME /data
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
