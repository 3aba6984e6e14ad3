"""The faust app for event-time features: validation, hot scores, CTR/CVR, recent behaviour."""
