#!/usr/bin/env sh
# The official image's entrypoint, with Debian's gosu where it has su-exec (same thing: setgid, setuid, exec).
set -e

loglevel="${loglevel:-}"
USERID=$(id -u)

# a first argument that looks like an option runs Envoy with it
if [ "${1#-}" != "$1" ]; then
    set -- envoy "$@"
fi

if [ "$1" = 'envoy' ] && [ -n "$loglevel" ]; then
    set -- "$@" --log-level "$loglevel"
fi

if [ "$ENVOY_UID" != "0" ] && [ "$USERID" = 0 ]; then
    if [ -n "$ENVOY_UID" ]; then
        usermod -u "$ENVOY_UID" envoy
    fi
    if [ -n "$ENVOY_GID" ]; then
        groupmod -g "$ENVOY_GID" envoy
    fi
    # the envoy user must be able to write the container's log
    chown envoy:envoy /dev/stdout /dev/stderr
    exec gosu envoy "$@"
else
    exec "$@"
fi
