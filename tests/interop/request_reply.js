// Ask a FreshRec worker for recommendations with kafkajs: the request/reply protocol from
// docs/serving.md, from a client outside the project.
// Usage: node request_reply.js BROKERS REQUESTS_TOPIC REPLY_TOPIC USER_ID K
// Prints the reply JSON (one line) and exits 0; exits 2 on timeout.
const crypto = require("crypto");
const { Kafka, logLevel } = require("kafkajs");

async function main() {
  const [brokers, requests, replies, userId, k] = process.argv.slice(2);
  const kafka = new Kafka({ clientId: "interop-rr", brokers: brokers.split(","), logLevel: logLevel.ERROR });
  const correlationId = crypto.randomUUID();
  const request = {
    schema_version: 1,
    request_id: `js-${correlationId}`,
    user_id: userId,
    k: Number(k),
    context: { device: "pc", region: "north" },
    deadline_ms: Date.now() + 20000,
  };

  // Listen first (a fresh group reading from the end), then ask.
  const consumer = kafka.consumer({ groupId: `rr-${correlationId}`, sessionTimeout: 6000,
                                    heartbeatInterval: 500, maxWaitTimeInMs: 20 });
  await consumer.connect();
  await consumer.subscribe({ topic: replies, fromBeginning: true });
  const timer = setTimeout(() => { console.error("timeout"); process.exit(2); }, 40000);
  await consumer.run({
    eachMessage: async ({ message }) => {
      const corr = message.headers && message.headers["correlation-id"];
      if (corr && corr.toString() === correlationId) {
        console.log(message.value.toString());
        clearTimeout(timer);
        process.exit(0);
      }
    },
  });

  const producer = kafka.producer();
  await producer.connect();
  // key = user_id: kafkajs partitions with murmur2 like the Java client, so the request lands
  // on the partition (and the worker) that also learns from this user's events.
  await producer.send({ topic: requests, messages: [{
    key: userId, value: JSON.stringify(request),
    headers: { "reply-to": replies, "correlation-id": correlationId },
  }] });
  await producer.disconnect();
}
main().catch((e) => { console.error(e); process.exit(1); });
