package broker

// Headers written by the broker. [rabbitmw.HeaderAttempts]
// ("x-rabbitmw-attempts") is written too: on a message sent to a delay
// queue when a layer counted the attempts, and always on a dead-lettered
// one.
const (
	// HeaderError is the error text of a dead-lettered message (a string
	// of at most 4 KiB).
	HeaderError = "x-rabbitmw-error"
	// HeaderErrorType is the type of the failure, as
	// [rabbitmw.ErrorType] names it: "panic", "timeout", "busy", a Go
	// type such as "*json.SyntaxError", or "error" for an error made by
	// errors.New or fmt.Errorf.
	HeaderErrorType = "x-rabbitmw-error-type"
	// HeaderFirstError and HeaderFirstFailedAt are the error text (at
	// most 512 bytes) and the time (a timestamp, UTC, whole seconds) of
	// the first failure the broker copied the message for: written on its
	// first delay copy, or, if it had none, left out of its dead-letter
	// copy, whose HeaderError and HeaderFailedAt then say the same. A
	// failure that is not counted (rabbitmw.NotCounted: busy, the store
	// unavailable) is not one. RabbitMQ's x-first-death-* name the first
	// time the server dead-lettered the message, which for a message
	// delayed on a retry is the first delay queue's expiry.
	HeaderFirstError    = "x-rabbitmw-first-error"
	HeaderFirstFailedAt = "x-rabbitmw-first-failed-at"
	// HeaderOriginalExchange and HeaderOriginalRoutingKey are the exchange
	// and routing key the message was first published with: recorded at
	// its first delay or dead-letter (or, for a message RabbitMQ
	// dead-lettered itself, at its replay, from its x-death record), and
	// kept at later hops. Consume gives them back to the delivery before
	// the handler runs, if it came as copies come (through the default
	// exchange, with the work queue as routing key): a message an
	// exchange routed keeps its own, whatever headers its producer set,
	// and its delay and dead-letter copies record its own, as they do its
	// UserId, Expiration and DeliveryMode.
	HeaderOriginalExchange   = "x-rabbitmw-original-exchange"
	HeaderOriginalRoutingKey = "x-rabbitmw-original-routing-key"
	// HeaderOriginalQueue is the work queue the message was dead-lettered
	// from.
	HeaderOriginalQueue = "x-rabbitmw-original-queue"
	// HeaderFailedAt is when the message was dead-lettered (a timestamp,
	// UTC, whole seconds).
	HeaderFailedAt = "x-rabbitmw-failed-at"
	// HeaderHost and HeaderProcess identify the consumer that
	// dead-lettered the message (Options.Host and Options.Process).
	HeaderHost    = "x-rabbitmw-host"
	HeaderProcess = "x-rabbitmw-process"
	// HeaderNotBefore is the time (Unix milliseconds, int64) before which
	// a message must not be handled: set on a message delayed longer than
	// the longest delay queue. A consumer that receives it earlier sends
	// it back to a delay queue for the remainder without handling it. A
	// value more than 7 days ahead is taken for a corrupt header: the
	// message is dead-lettered, with that reason.
	HeaderNotBefore = "x-rabbitmw-not-before"
	// HeaderUserID keeps the UserId property of a message that the broker
	// republishes (RabbitMQ refuses a publish whose user-id is not the
	// connection's user, so the copy goes without it). Consume gives it
	// back to the delivery before the handler runs, as it does
	// HeaderOriginalExpiration and HeaderOriginalDeliveryMode, under the
	// same condition as the original route. Unlike the property, the
	// header is not validated by RabbitMQ: a publisher allowed to publish
	// straight to the work queue can set it.
	HeaderUserID = "x-rabbitmw-user-id"
	// HeaderOriginalExpiration keeps the Expiration property (a per-message
	// TTL) of a message that the broker copies: no copy carries one, so
	// that nothing expires out of a delay or dead-letter queue, as
	// RabbitMQ's own dead-lettering removes it (and keeps it in x-death as
	// original-expiration).
	HeaderOriginalExpiration = "x-rabbitmw-original-expiration"
	// HeaderOriginalDeliveryMode keeps the DeliveryMode property (an
	// int64) of a message that was not persistent when the broker copied
	// it: every copy is persistent.
	HeaderOriginalDeliveryMode = "x-rabbitmw-original-delivery-mode"
	// HeaderOriginalCC keeps the CC header of a message that the broker
	// copies. RabbitMQ routes a message by the keys of its CC header too
	// (sender-selected distribution), and every copy goes through the
	// default exchange, where each queue is bound by its name: a copy that
	// carried it would reach the queues it names again. Consume gives it
	// back to the delivery as CC, under the same condition as the original
	// route. (RabbitMQ's own dead-lettering through a queue's
	// x-dead-letter-routing-key removes CC from the message.)
	HeaderOriginalCC = "x-rabbitmw-original-cc"
	// HeaderOriginalBCC keeps the BCC header, which RabbitMQ routes by as
	// it does CC and removes before delivery, of a message that the
	// broker copies: one imported from a record that has it.
	HeaderOriginalBCC = "x-rabbitmw-original-bcc"
	// HeaderMalformedXDeath keeps an x-death header that is not what
	// RabbitMQ itself writes (an array of tables, each with an integer
	// count), moved there from the copy sent to a delay queue: RabbitMQ
	// 3.10 updates x-death when the copy expires, and a malformed one
	// crashes the delay queue. A HeaderDeaths that is not in x-death's
	// form is kept there too, if HeaderMalformedXDeath is free, when the
	// delay copy needs HeaderDeaths for records of its own.
	HeaderMalformedXDeath = "x-rabbitmw-x-death"
	// HeaderDeaths keeps the x-death records that name the work queue:
	// those RabbitMQ wrote when it dead-lettered the message out of the
	// work queue (it expired there, or went past a length or delivery
	// limit, or was rejected) before the message came back to it, replayed
	// from the dead-letter queue by an operator or a shovel. When the delay
	// queue dead-letters a copy back to the work queue, RabbitMQ 3.10
	// takes such a record, with no reject among the later ones, for a
	// dead-letter cycle, and drops the copy. So the copy sent to a delay
	// queue carries those records here instead of in x-death: in x-death's
	// form (an array of tables), merged with the records moved there on
	// earlier hops, one record per queue and reason, the counts added, as
	// RabbitMQ counts. The copy keeps its x-death, empty if nothing else is
	// left, so that RabbitMQ leaves x-first-death-* as they were.
	//
	// So a handler sees, on a message back from a delay queue, x-death as
	// RabbitMQ wrote it but for the records that name the work queue, and
	// those records here. The dead-lettered copy has them back in x-death,
	// merged the same way, and no HeaderDeaths: the dead-letter queue shows
	// the message's whole history. (A HeaderDeaths not in x-death's form
	// is not merged.)
	HeaderDeaths = "x-rabbitmw-deaths"
)
