// Produce an event and consume one with kafkajs, against FreshRec's topics.
// Usage: node produce_consume.js BROKERS TOPIC EVENT_JSON EXPECT_KEY
// Prints one JSON line per consumed message, then exits when EXPECT_KEY was seen.
const { Kafka, logLevel } = require("kafkajs");

async function main() {
  const [brokers, topic, eventJson, expectKey] = process.argv.slice(2);
  const kafka = new Kafka({ clientId: "interop", brokers: brokers.split(","), logLevel: logLevel.ERROR });
  const producer = kafka.producer();
  await producer.connect();
  const event = JSON.parse(eventJson);
  // kafkajs 2 partitions keys with murmur2 by default, like the Java client.
  await producer.send({ topic, messages: [{ key: event.user_id, value: JSON.stringify(event),
                                            headers: { source: "kafkajs" } }] });
  await producer.disconnect();

  const consumer = kafka.consumer({ groupId: `interop-${Date.now()}`, sessionTimeout: 6000,
                                    heartbeatInterval: 500, maxWaitTimeInMs: 50 });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });
  const timer = setTimeout(() => { console.error("timeout"); process.exit(2); }, 30000);
  await consumer.run({
    eachMessage: async ({ partition, message }) => {
      const key = message.key ? message.key.toString() : null;
      console.log(JSON.stringify({ partition, key, value: message.value.toString() }));
      if (key === expectKey) {
        // Not consumer.disconnect() here: it waits for this very handler and deadlocks.
        clearTimeout(timer);
        process.exit(0);
      }
    },
  });
}
main().catch((e) => { console.error(e); process.exit(1); });
