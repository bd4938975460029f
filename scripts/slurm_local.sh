#!/usr/bin/env bash
# A single-node Slurm cluster on this machine for the tests marked `slurm` (tests/slurm/conftest.py) and for
# trying the Slurm launcher by hand: slurmctld and slurmd on 127.0.0.1, all daemons as root, state, logs and pids
# under $SLURM_BASE, no accounting database (job states come from squeue/scontrol), no cgroup.conf.
# Installs slurm-wlm with apt when it is missing (needs root).
#   usage: scripts/slurm_local.sh up|down|status
set -euo pipefail
SLURM_BASE=${SLURM_BASE:-/tmp/slurm-local}
NODE=$(hostname -s)
# nproc honours OMP_NUM_THREADS (the tests set it to 1): a node of 1 CPU leaves every 2-CPU job pending
# (PartitionConfig) for good. The cores this process may run on, whatever OpenMP is told.
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
MEM_MB=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 2048 ))

wait_for() {  # wait_for <seconds> <cmd...>
  local n=$(( $1 * 5 )); shift
  for _ in $(seq 1 "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "timeout waiting for: $*" >&2; return 1
}
stop_daemons() {  # SIGTERM the pid in each file at once, then wait for each: each takes seconds to stop, and
  local f pid pids=()  # one after another they added up at the end of every test session
  for f in "$@"; do
    [ -s "$f" ] && pid=$(cat "$f") && kill "$pid" 2>/dev/null && pids+=("$pid:$f")
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 150); do kill -0 "${pid%%:*}" 2>/dev/null || continue 2; sleep 0.2; done
    echo "pid ${pid%%:*} from ${pid#*:} did not stop" >&2; return 1
  done
}

install() {
  command -v slurmctld >/dev/null && return 0
  if [ "$(id -u)" != 0 ]; then echo "slurm-wlm is not installed and installing it needs root" >&2; return 3; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null
}

up() {
  install
  if [ "$(id -u)" != 0 ]; then echo "starting slurmctld/slurmd as configured here needs root" >&2; return 3; fi
  mkdir -p "$SLURM_BASE"/{state,spool,log} /run/munge /etc/slurm
  chown munge:munge /run/munge; chmod 0755 /run/munge
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=localcluster
SlurmctldHost=${NODE}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=${SLURM_BASE}/state
SlurmdSpoolDir=${SLURM_BASE}/spool
SlurmctldPidFile=${SLURM_BASE}/slurmctld.pid
SlurmdPidFile=${SLURM_BASE}/slurmd.pid
SlurmctldLogFile=${SLURM_BASE}/log/slurmctld.log
SlurmdLogFile=${SLURM_BASE}/log/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=30
MinJobAge=300
NodeName=${NODE} NodeAddr=127.0.0.1 CPUs=${CPUS} Boards=1 SocketsPerBoard=1 CoresPerSocket=${CPUS} ThreadsPerCore=1 RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=debug Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
CONF
  rm -f /etc/slurm/cgroup.conf   # 22.05 has no "disabled" cgroup plugin; without the file nothing is enforced
  pgrep -u munge -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
  wait_for 10 sh -c 'munge -n | unmunge'
  [ -s "$SLURM_BASE/slurmctld.pid" ] && kill -0 "$(cat "$SLURM_BASE/slurmctld.pid")" 2>/dev/null || slurmctld
  [ -s "$SLURM_BASE/slurmd.pid" ] && kill -0 "$(cat "$SLURM_BASE/slurmd.pid")" 2>/dev/null || slurmd
  wait_for 30 sh -c "sinfo -h -o %T | grep -qE '^(idle|mixed|allocated)'"
  sinfo
}

down() {
  stop_daemons "$SLURM_BASE/slurmd.pid" "$SLURM_BASE/slurmctld.pid" /run/munge/munged.pid
}

status() { sinfo; squeue; }

case "${1:-up}" in up) up ;; down) down ;; status) status ;; *) echo "usage: $0 up|down|status" >&2; exit 2 ;; esac
