"""The inference worker: embedding cache, local fine-tuning and serving over Kafka."""
