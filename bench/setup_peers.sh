#!/usr/bin/env bash
# Install the benchmark's peers if they are missing; safe to run again.
#
#   bash bench/setup_peers.sh [beanstalkd] [redis] [persistq]     (default: all three)
#
# Servers come from Debian packages (apt-get, as root); Python clients are pip-installed into
# $PYTHON (default: python3), the interpreter that runs the benchmark. bench/run.py calls
# this for the peers it finds missing unless given --no-install.
set -u

PYTHON="${PYTHON:-python3}"
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(beanstalkd redis persistq)
status=0
apt_updated=0

say() { echo "setup_peers: $*" >&2; }

apt_install() {  # apt_install <command> <package>
    command -v "$1" >/dev/null 2>&1 && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        say "$1 missing; install the Debian package $2 (needs root and apt-get)"
        return 1
    fi
    say "apt-get install $2"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq "$2" >&2; then
        if [ "$apt_updated" = 0 ]; then
            apt-get update -qq >&2 && apt_updated=1
            apt-get install -y -qq "$2" >&2 || { say "could not install $2"; return 1; }
        else
            say "could not install $2"; return 1
        fi
    fi
}

pip_install() {  # pip_install <module> <requirement>
    "$PYTHON" -c "import $1" >/dev/null 2>&1 && return 0
    say "pip install $2 into $PYTHON"
    "$PYTHON" -m pip install -q "$2" >&2 || { say "could not pip install $2"; return 1; }
}

for peer in "${peers[@]}"; do
    case "$peer" in
        beanstalkd) apt_install beanstalkd beanstalkd || status=1 ;;
        redis)      apt_install redis-server redis-server || status=1
                    pip_install redis 'redis>=5' || status=1 ;;
        persistq)   pip_install persistqueue 'persist-queue>=1.0' || status=1 ;;
        shardq)     ;;  # the package under test: pip install -e .
        *)          say "unknown peer $peer"; status=1 ;;
    esac
done
exit $status
