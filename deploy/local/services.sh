#!/usr/bin/env bash
# Local PostgreSQL and Apache Kafka (KRaft, single node) for idem, without Docker.
#
#   deploy/local/services.sh up      start whatever is not already answering (idempotent)
#   deploy/local/services.sh down    stop only what this script started (pid/marker files)
#   deploy/local/services.sh status  say what answers
#
# PostgreSQL: postgres://idem:idem@127.0.0.1:5432/idem   (Debian's packages)
#             ssl = on with the local CA's certificate; role idem_tls / idem-tls connects
#             over TLS only (hostssl)
# Kafka:      127.0.0.1:9092                              (jars from Maven Central, Java 17)
#             localhost:9094  SASL_SSL, SCRAM-SHA-512 user idem / idem-secret, certificate
#                             signed by the local CA in $IDEM_LOCAL_DIR/tls/ca.pem
#
# State (jars, data, logs, pid files) lives outside the repo in $IDEM_LOCAL_DIR
# (default ~/.cache/idem-local), so a fresh clone reuses what an earlier run fetched.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
state=${IDEM_LOCAL_DIR:-$HOME/.cache/idem-local}
kafka_dir=$state/kafka
kafka_version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$here/kafka-pom.xml")
# The jar cache is keyed by the pom's content: editing the pom fetches afresh.
kafka_libs=$kafka_dir/libs-$kafka_version-$(sha256sum "$here/kafka-pom.xml" | cut -c1-12)
pg_port=5432
kafka_port=9092
controller_port=9093
sasl_port=9094
tls_dir=$state/tls

log() { printf 'services: %s\n' "$*" >&2; }
die() { printf 'services: error: %s\n' "$*" >&2; exit 1; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_for DESCRIPTION DEADLINE_SECONDS LOGFILE COMMAND...
wait_for() {
  local what=$1 secs=$2 logfile=$3
  local deadline=$(( SECONDS + secs ))
  shift 3
  until "$@" >/dev/null 2>&1; do
    if (( SECONDS >= deadline )); then
      [ -f "$logfile" ] && tail -n 30 "$logfile" >&2
      die "$what did not become ready within ${secs}s; see $logfile"
    fi
    sleep 0.5
  done
}

# ----------------------------------------------------------------------- TLS

# A local CA, a server certificate it signs for localhost and 127.0.0.1 (Kafka's SASL_SSL
# listener uses it as a PKCS#12 keystore), and a second CA that signed nothing, for tests of a
# client that trusts the wrong one. Made once.
tls_make() {
  [ -f "$tls_dir/.complete" ] && return 0
  command -v openssl >/dev/null || die "openssl is needed to make the local test certificates"
  log "making a local CA and server certificate in $tls_dir"
  rm -rf "$tls_dir"
  mkdir -p "$tls_dir"
  (
    cd "$tls_dir"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=idem local CA" \
      -keyout ca.key -out ca.pem 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr 2>/dev/null
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' > server.ext
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile server.ext -out server.pem 2>/dev/null
    openssl pkcs12 -export -in server.pem -inkey server.key -name kafka -passout pass:idem-local \
      -out kafka.p12
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=some other CA" \
      -keyout other-ca.key -out other-ca.pem 2>/dev/null
    chmod 644 ./*
  )
  touch "$tls_dir/.complete"
}

# A client certificate the local CA signs, for tests of mutual TLS with a downstream. Made once,
# beside (not with) the CA, so adding it later does not renew the servers' certificates.
tls_client_cert() {
  [ -f "$tls_dir/client.pem" ] && return 0
  (
    cd "$tls_dir"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=idem client" -keyout client.key -out client.csr 2>/dev/null
    printf 'extendedKeyUsage=clientAuth\n' > client.ext
    openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
      -extfile client.ext -out client.pem 2>/dev/null
    chmod 644 client.*
  )
}

# ---------------------------------------------------------------- PostgreSQL

pg_ready() { pg_isready -q -h 127.0.0.1 -p "$pg_port"; }

pg_as_superuser() { (cd / && runuser -u postgres -- psql -v ON_ERROR_STOP=1 -qAt -p "$pg_port" "$@"); }

pg_up() {
  mkdir -p "$state"
  if ! pg_ready 2>/dev/null; then
    if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
      log "installing postgresql from Debian's packages"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq postgresql >/dev/null
    fi
    local version
    version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
    if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main"' | grep -q .; then
      log "creating cluster $version/main"
      pg_createcluster "$version" main -p "$pg_port" >/dev/null
    fi
    # Sized for a service that commits thousands of small transactions a second: fewer
    # checkpoints (each is followed by full-page writes), statement statistics for profiling,
    # and a quarter of the memory for shared buffers (up to 8 GB), where idem's indexes must
    # fit as the tables grow: about 365 MiB per million keys kept. With ten million keys and 1
    # GB of buffers, a new action cost Postgres a third more CPU than on an empty schema (the
    # B-tree pages went through the OS cache); with 6 GB holding them, a fifth (benches/HISTORY.md,
    # stop 39). Durability stays as shipped: fsync and synchronous_commit are on.
    # The memory is the machine's, or a container's limit when it has a lower one.
    local memory_kb limit
    memory_kb=$(awk '/^MemTotal:/ { print $2 }' /proc/meminfo)
    limit=$(cat /sys/fs/cgroup/memory.max 2>/dev/null || true)
    if [[ "$limit" =~ ^[0-9]+$ ]] && [ $((limit / 1024)) -lt "${memory_kb:-0}" ]; then
      memory_kb=$((limit / 1024))
    fi
    local buffers_mb=$(( ${memory_kb:-4194304} / 4096 ))
    [ "$buffers_mb" -gt 8192 ] && buffers_mb=8192
    [ "$buffers_mb" -lt 128 ] && buffers_mb=128
    cat > "/etc/postgresql/$version/main/conf.d/idem.conf" <<CONF
shared_buffers = ${buffers_mb}MB
max_wal_size = 8GB
checkpoint_timeout = 15min
shared_preload_libraries = 'pg_stat_statements'
CONF
    log "starting cluster $version/main"
    pg_ctlcluster "$version" main start
    echo "$version" > "$state/postgres.started"
    wait_for "PostgreSQL" 60 "/var/log/postgresql/postgresql-$version-main.log" pg_ready
  fi
  if ! PGPASSWORD=idem psql -qAt -h 127.0.0.1 -p "$pg_port" -U idem -d idem -c 'select 1' >/dev/null 2>&1; then
    if ! command -v runuser >/dev/null || ! id postgres >/dev/null 2>&1; then
      die "a PostgreSQL server answers on 127.0.0.1:$pg_port but role/database idem is missing; create them (password idem)"
    fi
    log "creating role and database idem"
    if [ -z "$(pg_as_superuser -c "select 1 from pg_roles where rolname = 'idem'")" ]; then
      pg_as_superuser -c "create role idem login password 'idem'"
    fi
    if [ -z "$(pg_as_superuser -c "select 1 from pg_database where datname = 'idem'")" ]; then
      pg_as_superuser -c "create database idem owner idem"
    fi
  fi
  pg_tls
  # Statement statistics, for profiling (`select * from pg_stat_statements`).
  if command -v runuser >/dev/null && id postgres >/dev/null 2>&1 &&
     [ -z "$(pg_as_superuser -d idem -c "select 1 from pg_extension where extname = 'pg_stat_statements'")" ]; then
    pg_as_superuser -d idem -c "create extension pg_stat_statements; grant pg_read_all_stats to idem" || true
  fi
  log "postgres ready: postgres://idem:idem@127.0.0.1:$pg_port/idem"
}

# TLS on the local server, with the local CA's certificate, and a role that may only connect
# over it (idem_tls / idem-tls, hostssl only): what the Postgres TLS tests connect as.
pg_tls() {
  command -v runuser >/dev/null && id postgres >/dev/null 2>&1 || return 0
  tls_make
  local version etc
  version=$(pg_as_superuser -c "show server_version_num" | cut -c1-2)
  etc=/etc/postgresql/$version/main
  [ -d "$etc" ] || return 0
  local changed=0
  if ! cmp -s "$tls_dir/server.pem" "$etc/idem-server.pem" 2>/dev/null; then
    install -o postgres -g postgres -m 0644 "$tls_dir/server.pem" "$etc/idem-server.pem"
    install -o postgres -g postgres -m 0600 "$tls_dir/server.key" "$etc/idem-server.key"
    changed=1
  fi
  local conf=$etc/conf.d/idem-tls.conf
  if [ ! -f "$conf" ]; then
    printf "ssl = on\nssl_cert_file = '%s'\nssl_key_file = '%s'\n" \
      "$etc/idem-server.pem" "$etc/idem-server.key" > "$conf"
    changed=1
  fi
  # First match wins: these go above Debian's own lines.
  if ! grep -q '^# idem: idem_tls' "$etc/pg_hba.conf"; then
    { printf '# idem: idem_tls connects over TLS only\n'
      printf 'hostssl   all idem_tls 127.0.0.1/32 scram-sha-256\n'
      printf 'hostssl   all idem_tls ::1/128      scram-sha-256\n'
      printf 'hostnossl all idem_tls 127.0.0.1/32 reject\n'
      printf 'hostnossl all idem_tls ::1/128      reject\n'
      cat "$etc/pg_hba.conf"; } > "$etc/pg_hba.conf.new"
    chown postgres:postgres "$etc/pg_hba.conf.new"
    mv "$etc/pg_hba.conf.new" "$etc/pg_hba.conf"
    changed=1
  fi
  if [ -z "$(pg_as_superuser -c "select 1 from pg_roles where rolname = 'idem_tls'")" ]; then
    # idem may drop what the tests made as idem_tls (deploy/test.sh cleans schemas as idem).
    pg_as_superuser -c "create role idem_tls login password 'idem-tls'; grant create, connect on database idem to idem_tls; grant idem_tls to idem"
  fi
  if [ $changed = 1 ]; then
    pg_as_superuser -c "select pg_reload_conf()" >/dev/null
    wait_for "PostgreSQL with ssl = on" 30 "/var/log/postgresql/postgresql-$version-main.log" pg_ssl_on
    log "postgres TLS: postgres://idem_tls:idem-tls@localhost:$pg_port/idem?sslmode=verify-full&sslrootcert=$tls_dir/ca.pem"
  fi
}

pg_ssl_on() { [ "$(pg_as_superuser -c 'show ssl')" = on ]; }

pg_down() {
  if [ -f "$state/postgres.started" ]; then
    pg_ctlcluster "$(cat "$state/postgres.started")" main stop || true
    rm -f "$state/postgres.started"
    log "postgres stopped"
  fi
}

# --------------------------------------------------------------------- Kafka

kafka_cp() { echo "$kafka_libs/*"; }

kafka_java() { java -Xmx256m -Dlog4j2.configurationFile="$kafka_dir/log4j2.xml" -cp "$(kafka_cp)" "$@"; }

# A metadata request through the broker's own admin client: the port alone opens before the
# broker can answer.
kafka_metadata_ok() {
  timeout 30 java -Xmx256m -Dlog4j2.configurationFile="$kafka_dir/log4j2.xml" -cp "$(kafka_cp)" \
    org.apache.kafka.tools.TopicCommand --bootstrap-server "127.0.0.1:$kafka_port" --list
}

kafka_ready() { port_open "$kafka_port" && kafka_metadata_ok; }

# Deletes the topics whose whole name matches $1 (a regular expression both grep -E and Java
# read alike): each test and benchmark run makes its own, and a broker holding thousands of
# partitions starts and recovers each of them after a kill.
kafka_prune_topics() {
  local pattern=$1 topics
  topics=$(kafka_metadata_ok | grep -xE "$pattern" || true)
  [ -n "$topics" ] || return 0
  log "deleting $(wc -l <<<"$topics") topics earlier runs left"
  kafka_java org.apache.kafka.tools.TopicCommand --bootstrap-server "127.0.0.1:$kafka_port" \
    --delete --topic "$pattern" >/dev/null
}

kafka_fetch() {
  local libs=$kafka_libs
  [ -f "$libs/.complete" ] && return 0
  command -v mvn >/dev/null || die "mvn is needed once to fetch the Kafka jars from Maven Central"
  log "fetching Apache Kafka $kafka_version jars from Maven Central into $libs"
  rm -rf "$libs"
  mvn -q -B -f "$here/kafka-pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$libs" >&2
  touch "$libs/.complete"
}

kafka_configure() {
  mkdir -p "$kafka_dir/data" "$kafka_dir/logs"
  cat > "$kafka_dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$controller_port
listeners=PLAINTEXT://127.0.0.1:$kafka_port,CONTROLLER://127.0.0.1:$controller_port,SASL_SSL://127.0.0.1:$sasl_port
advertised.listeners=PLAINTEXT://127.0.0.1:$kafka_port,SASL_SSL://localhost:$sasl_port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL
listener.name.sasl_ssl.sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.ssl.keystore.type=PKCS12
listener.name.sasl_ssl.ssl.keystore.location=$tls_dir/kafka.p12
listener.name.sasl_ssl.ssl.keystore.password=idem-local
listener.name.sasl_ssl.ssl.key.password=idem-local
log.dirs=$kafka_dir/data
auto.create.topics.enable=false
num.partitions=1
default.replication.factor=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.flush.interval.messages=9223372036854775807
PROPS
  cat > "$kafka_dir/log4j2.xml" <<'XML'
<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="WARN">
  <Appenders>
    <Console name="stdout" target="SYSTEM_OUT">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Logger name="kafka" level="INFO"/>
    <Logger name="org.apache.kafka" level="INFO"/>
    <Root level="WARN"><AppenderRef ref="stdout"/></Root>
  </Loggers>
</Configuration>
XML
  if [ ! -f "$kafka_dir/data/meta.properties" ]; then
    log "formatting KRaft storage in $kafka_dir/data"
    local cluster_id
    cluster_id=$(kafka_java kafka.tools.StorageTool random-uuid)
    kafka_java kafka.tools.StorageTool format -t "$cluster_id" -c "$kafka_dir/server.properties" \
      >"$kafka_dir/logs/format.log" 2>&1 || { cat "$kafka_dir/logs/format.log" >&2; die "kafka storage format failed"; }
  fi
}

# Alive: the process exists and is not a zombie (a kill -9'd broker no init has reaped yet).
pid_alive() { [ -r "/proc/$1/stat" ] && ! awk '{ sub(/.*\) /, ""); exit ($1 == "Z" ? 0 : 1) }' "/proc/$1/stat"; }

kafka_up() {
  tls_make
  tls_client_cert
  # A broker this script started that has died (kill -9): its port can still accept for a
  # moment while the kernel tears it down, which would pass for "already running".
  if [ -f "$kafka_dir/kafka.pid" ] && ! pid_alive "$(cat "$kafka_dir/kafka.pid")"; then
    rm -f "$kafka_dir/kafka.pid"
    wait_for "the dead Kafka to let go of $kafka_port" 60 "$kafka_dir/logs/server.log" port_closed "$kafka_port"
  fi
  # A broker this script started before the SASL_SSL listener existed: restart it with it.
  if port_open "$kafka_port" && ! port_open "$sasl_port" && [ -f "$kafka_dir/kafka.pid" ]; then
    log "restarting Kafka to add the SASL_SSL listener on $sasl_port"
    kafka_down
    wait_for "the old Kafka to let go of $kafka_port" 60 "$kafka_dir/logs/server.log" port_closed "$kafka_port"
  fi
  if port_open "$kafka_port"; then
    wait_for "Kafka on 127.0.0.1:$kafka_port (already running)" 90 "$kafka_dir/logs/server.log" kafka_ready_existing
    kafka_scram_user
    log "kafka ready: 127.0.0.1:$kafka_port"
    return 0
  fi
  command -v java >/dev/null || die "java (17) is needed to run Kafka"
  kafka_fetch
  kafka_configure
  log "starting Kafka $kafka_version (log: $kafka_dir/logs/server.log)"
  nohup java -Xms512m -Xmx1g -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$kafka_dir/log4j2.xml" \
    -cp "$(kafka_cp)" kafka.Kafka "$kafka_dir/server.properties" \
    >>"$kafka_dir/logs/server.log" 2>&1 </dev/null &
  echo $! > "$kafka_dir/kafka.pid"
  wait_for "Kafka on 127.0.0.1:$kafka_port" 120 "$kafka_dir/logs/server.log" kafka_ready_started
  kafka_scram_user
  log "kafka ready: 127.0.0.1:$kafka_port, SASL_SSL on localhost:$sasl_port"
}

port_closed() { ! port_open "$1"; }

# The SCRAM user of the SASL_SSL listener; credentials live in the cluster metadata, so once.
kafka_scram_user() {
  [ -f "$kafka_dir/data/.scram-idem" ] && return 0
  kafka_java kafka.admin.ConfigCommand --bootstrap-server "127.0.0.1:$kafka_port" --alter \
    --add-config 'SCRAM-SHA-512=[iterations=4096,password=idem-secret]' \
    --entity-type users --entity-name idem >"$kafka_dir/logs/scram.log" 2>&1 ||
    { cat "$kafka_dir/logs/scram.log" >&2; die "cannot create the SCRAM user idem"; }
  touch "$kafka_dir/data/.scram-idem"
}

# Readiness of a broker we started: the process must still be alive, then a metadata request.
kafka_ready_started() {
  kill -0 "$(cat "$kafka_dir/kafka.pid")" 2>/dev/null || { tail -n 30 "$kafka_dir/logs/server.log" >&2; die "Kafka exited; see $kafka_dir/logs/server.log"; }
  kafka_ready
}

# A broker somebody else runs: we may not have its jars yet, but fetch them to ask for metadata.
kafka_ready_existing() { kafka_fetch; [ -f "$kafka_dir/log4j2.xml" ] || kafka_configure; kafka_ready; }

kafka_down() {
  local pidfile=$kafka_dir/kafka.pid
  [ -f "$pidfile" ] || return 0
  local pid
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
    log "kafka stopped"
  fi
  rm -f "$pidfile"
}

# ---------------------------------------------------------------------- main

case "${1:-up}" in
  up) pg_up; kafka_up ;;
  down) kafka_down; pg_down ;;
  prune-topics) kafka_prune_topics "${2:?a topic name pattern}" ;;
  status)
    pg_ready 2>/dev/null && echo "postgres: ready on 127.0.0.1:$pg_port" || echo "postgres: not answering"
    port_open "$kafka_port" && echo "kafka: listening on 127.0.0.1:$kafka_port" || echo "kafka: not answering" ;;
  *) die "usage: $0 up|down|status|prune-topics PATTERN" ;;
esac
