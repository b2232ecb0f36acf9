#!/bin/sh
# The official image's entrypoint, reduced to what it does for redis-server: options as first argument are
# redis-server's; as root, own /data and drop to the redis user (gosu where Alpine's image has su-exec).
set -e

if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
    set -- redis-server "$@"
fi

if [ "$1" = 'redis-server' ] && [ "$(id -u)" = '0' ]; then
    find . \! -user redis -exec chown redis '{}' +
    exec gosu redis "$0" "$@"
fi

# The official build compiles protected mode off (a container's clients are never on its loopback); Debian's
# binary has it on, so it is switched off here, before the command's own options, which can still turn it on.
if [ "$1" = 'redis-server' ]; then
    shift
    case "${1:-}" in
        '' | -*) set -- redis-server --protected-mode no "$@" ;;
        *) conf="$1"; shift; set -- redis-server "$conf" --protected-mode no "$@" ;; # a config file comes first
    esac
fi

umask 0077
exec "$@"
