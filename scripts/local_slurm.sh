#!/usr/bin/env bash
# A one-node SLURM with accounting on this machine, to try the cluster path (hydra/launcher=slurm,
# submitit) on a laptop or a CI box: slurmctld + slurmd + slurmdbd on MariaDB, munge, partition
# "cpu". Needs root and apt (Debian/Ubuntu); installs what is missing, writes the configuration,
# starts what is not running. Safe to run again.
#   scripts/local_slurm.sh          install if needed, configure, start (waits until the node is idle)
#   scripts/local_slurm.sh status   exit 0 when the cluster answers, 1 otherwise
#   scripts/local_slurm.sh stop     stop the daemons (packages and configuration stay)
set -euo pipefail

CLUSTER=snapkvbench
STATE=/var/lib/snapkv-slurm
PACKAGES="slurmctld slurmd slurmdbd slurm-client munge mariadb-server"

die() { echo "local_slurm: $*" >&2; exit 3; }

status() { sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc" && sacct -n -X -S now-1minutes >/dev/null 2>&1; }

stop() {
  for d in slurmd slurmctld slurmdbd; do pkill -x "$d" 2>/dev/null || true; done
  mysqladmin shutdown 2>/dev/null || true
  pkill -x munged 2>/dev/null || true
  echo "local_slurm: stopped"
}

case "${1:-start}" in
  status) status; exit $? ;;
  stop) stop; exit 0 ;;
  start) ;;
  *) echo "usage: scripts/local_slurm.sh [start|status|stop]" >&2; exit 2 ;;
esac

[ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts system daemons)"
command -v apt-get >/dev/null || die "needs apt-get (Debian/Ubuntu)"

missing=""
for p in $PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "local_slurm: installing$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p $STATE/ctld $STATE/d /var/log/slurm /run/munge /run/mysqld /etc/slurm
chown munge:munge /run/munge 2>/dev/null || true
chown mysql:mysql /run/mysqld 2>/dev/null || true

# whether a daemon is alive: a zombie left by one that died does not count (pgrep -x would match it)
running() { ps -C "$1" -o stat= 2>/dev/null | grep -qv '^Z'; }

# munge: the key the package made, a daemon as the munge user
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null;
                                  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
running munged || runuser -u munge -- /usr/sbin/munged

# MariaDB for slurmdbd
# (a socket left by a server that was killed is stale: ping, not the socket, says whether one runs)
if ! mysqladmin ping >/dev/null 2>&1; then
  rm -f /run/mysqld/mysqld.sock /run/mysqld/mysqld.pid
  [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null
  (setsid mariadbd --user=mysql --datadir=/var/lib/mysql --socket=/run/mysqld/mysqld.sock \
     >/var/log/slurm/mariadb.log 2>&1 &)
  for _ in $(seq 60); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.5; done
fi
mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
            ALTER USER 'slurm'@'localhost' IDENTIFIED BY 'slurm';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

cat > /etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=/var/log/slurm/slurmdbd.log
PidFile=$STATE/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
CONF
chmod 600 /etc/slurm/slurmdbd.conf

cat > /etc/slurm/slurm.conf <<CONF
ClusterName=$CLUSTER
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
KillWait=5
MinJobAge=60
InactiveLimit=0
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=cpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF

running slurmdbd || slurmdbd
for _ in $(seq 60); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.5; done
sacctmgr -i add cluster $CLUSTER >/dev/null 2>&1 || true
running slurmctld || slurmctld
running slurmd || slurmd
for _ in $(seq 120); do status && break; sleep 0.5; done
status || die "the cluster did not come up; see /var/log/slurm/*.log"
scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
echo "local_slurm: cluster '$CLUSTER' up: partition cpu, node $HOST ($CPUS CPUs, $MEM_MB MB), accounting on"
echo "local_slurm: stop it with scripts/local_slurm.sh stop"
