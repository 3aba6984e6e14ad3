"""The asynchronous parameter server: aggregate gradients, sparse Adagrad, versioned broadcast."""
