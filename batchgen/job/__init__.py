"""One ``batchgen run`` job: rows read into requests, the engine driven, finished rows made durable, resumed,
summarised and reported."""
