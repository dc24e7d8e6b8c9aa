#!/bin/sh
# Launch agent for Open MPI / PRRTE (--prtemca plm_ssh_agent): instead of ssh'ing to a host,
# run the daemon command inside the network namespace that owns the host's address.
# Called as: netns_agent.sh [ssh options] HOST COMMAND WORDS...
# The address -> namespace map comes from LCC_NETNS_HOSTS="10.77.0.2=ns1,10.77.0.3=ns2"
# (set by tests/netns/simhosts.py; inherited from mpirun's environment).
while [ $# -gt 0 ]; do
    case "$1" in
        -x|-T|-n|-a|-q) shift ;;
        -o|-p|-l|-i) shift 2 ;;
        *) break ;;
    esac
done
host="$1"; shift
ns=""
old_ifs="$IFS"; IFS=','
for pair in $LCC_NETNS_HOSTS; do
    if [ "${pair%%=*}" = "$host" ]; then ns="${pair#*=}"; fi
done
IFS="$old_ifs"
if [ -z "$ns" ]; then
    echo "netns_agent: no namespace for host '$host' in LCC_NETNS_HOSTS='$LCC_NETNS_HOSTS'" >&2
    exit 255
fi
# Own UTS namespace with hostname = namespace name, so Open MPI sees distinct nodes.
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname '$ns'; $*"
