#!/bin/bash
# One KRaft node (broker and controller) whose clients must authenticate: SASL/SCRAM-SHA-512 on
# the listeners other containers and the host use, one Kafka user per FreshRec service, ACLs
# enforced (StandardAuthorizer, nothing allowed without an ACL; `freshrec topics create --acls`
# grants each service what it needs). The controller listener is on the container's loopback.
# The users' passwords come from the environment; there are no defaults.
set -euo pipefail
: "${KAFKA_ADMIN_PASSWORD:?set KAFKA_ADMIN_PASSWORD}"
: "${KAFKA_STREAMS_PASSWORD:?set KAFKA_STREAMS_PASSWORD}"
: "${KAFKA_WORKER_PASSWORD:?set KAFKA_WORKER_PASSWORD}"
: "${KAFKA_PARAM_SERVER_PASSWORD:?set KAFKA_PARAM_SERVER_PASSWORD}"
: "${KAFKA_CLIENT_PASSWORD:?set KAFKA_CLIENT_PASSWORD}"
KAFKA_EXTERNAL_HOST=${KAFKA_EXTERNAL_HOST:-localhost}
props=/tmp/server.properties
cat >"$props" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@localhost:9093
listeners=INTERNAL://:9092,CONTROLLER://localhost:9093,EXTERNAL://:9094
advertised.listeners=INTERNAL://kafka:9092,EXTERNAL://${KAFKA_EXTERNAL_HOST}:9094
listener.security.protocol.map=INTERNAL:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT,EXTERNAL:SASL_PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=INTERNAL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.internal.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="${KAFKA_ADMIN_PASSWORD}";
listener.name.external.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:admin;User:ANONYMOUS
allow.everyone.if.no.acl.found=false
auto.create.topics.enable=false
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
log.dirs=/var/lib/kafka/data
PROPS
# ANONYMOUS is the controller listener's principal (loopback only): the node talking to itself.
if [ ! -f /var/lib/kafka/data/meta.properties ]; then
  /opt/kafka/bin/kafka-storage.sh format -c "$props" -t "$(/opt/kafka/bin/kafka-storage.sh random-uuid)" \
    --add-scram "SCRAM-SHA-512=[name=admin,password=${KAFKA_ADMIN_PASSWORD}]" \
    --add-scram "SCRAM-SHA-512=[name=streams,password=${KAFKA_STREAMS_PASSWORD}]" \
    --add-scram "SCRAM-SHA-512=[name=worker,password=${KAFKA_WORKER_PASSWORD}]" \
    --add-scram "SCRAM-SHA-512=[name=param-server,password=${KAFKA_PARAM_SERVER_PASSWORD}]" \
    --add-scram "SCRAM-SHA-512=[name=client,password=${KAFKA_CLIENT_PASSWORD}]"
fi
exec /opt/kafka/bin/kafka-server-start.sh "$props"
