// Package broker runs a [rabbitmw.Handler] against RabbitMQ, and settles
// every delivery by the handler's result: acknowledged, requeued, retried
// after a delay, or moved to a dead-letter queue with headers that say why.
// It reconnects after a lost connection, shuts down gracefully, publishes
// with confirms. Package brokertest provides an in-memory stand-in for
// RabbitMQ on which the same code runs, for tests.
//
//	b := broker.New("amqp://guest:guest@127.0.0.1:5672/", broker.Options{Logger: logger})
//	defer b.Close()
//	err := b.Consume(ctx, "orders", chain(handler), broker.ConsumeOptions{})
//
// # Queues
//
// For a work queue Q, the topology ([Topology]) has these queues, all
// durable, all reached through the default exchange:
//
//	Q             the work queue: classic, or quorum (x-queue-type=quorum);
//	              x-dead-letter-exchange "" and x-dead-letter-routing-key
//	              "Q.dlq", so that a plain reject and a quorum queue's
//	              x-delivery-limit also land in the dead-letter queue
//	Q.dlq         the dead-letter queue: classic, no arguments; or quorum
//	              (QuorumSupport: x-queue-type=quorum)
//	Q.delay.<t>   one delay queue per tier t of the ladder (default 1s, 5s,
//	              30s, 2m, 10m, 1h): classic, x-message-ttl = t in ms,
//	              x-dead-letter-exchange "", x-dead-letter-routing-key "Q";
//	              or quorum (QuorumSupport: also x-queue-type=quorum,
//	              x-dead-letter-strategy=at-least-once,
//	              x-overflow=reject-publish)
//
// A tier is named in its largest exact unit: "1s", "5s", "30s", "2m",
// "10m", "1h", "1500ms". With DeclareAll (the default) Consume declares all
// of them; with [DeclareSupport] all but Q, whose existence it checks; with
// DeclareNone none. Declaring is idempotent and safe from many consumers at
// once. A work queue that exists with other arguments is a fatal error
// (ErrQueueArguments) whose text names the fix.
//
// # Settlement
//
// Each delivery is settled once, by the outcome that [rabbitmw.Decide]
// gives the handler's result (the contract is on [rabbitmw.Handler]):
//
//	Ack, Duplicate     basic.ack (coalesced: see Acks below)
//	Requeue            basic.nack, requeue
//	Delay d            copy to Q.delay.<t>, t the shortest tier >= d;
//	                   ack once the copy is confirmed
//	DeadLetter         copy with fault headers to Q.dlq;
//	                   ack once the copy is confirmed
//	a panic            as DeadLetter, with a *rabbitmw.PanicError
//
// A copy keeps the message's properties but three, each kept in a header:
// Expiration (HeaderOriginalExpiration: nothing in a delay or dead-letter
// queue expires, as RabbitMQ's own dead-lettering removes the property),
// UserId (HeaderUserID: RabbitMQ refuses a publish by another user), and
// DeliveryMode (a copy is persistent; HeaderOriginalDeliveryMode keeps a
// mode that was not). It keeps its body and all its headers, whatever
// their types, including those RabbitMQ adds (x-death, x-delivery-count),
// but CC and BCC, by which RabbitMQ would route it to the queues they name
// as well as its own: it keeps them in HeaderOriginalCC and
// HeaderOriginalBCC, and the handler sees CC as it was. A copy sent to a
// delay queue carries the x-death records that name Q in HeaderDeaths
// instead, lest RabbitMQ drop it as a dead-letter cycle. It is persistent. It carries
// the attempt count ([rabbitmw.HeaderAttempts]) and the original exchange
// and routing key; a dead-lettered copy also the fault headers: error text
// and type, work queue, time, host and process (see the Header
// constants). The original is acked once the copy is confirmed; when the
// server refuses the copy, the original is nacked with requeue after about
// a second; while the copy's fate is unknown, the original is never
// settled (see below). A copy that can never be sent (ErrInvalidMessage)
// is not tried again (see Copies that fail, below).
//
// A delay longer than the longest tier goes to the longest tier, with the
// HeaderNotBefore header; a consumer that
// receives the message before that time sends it back to a delay queue for
// the remainder without handling it. So a message is never handled sooner than the delay asked for; it may
// be handled later, by up to the gap between tiers (a delay of 6s waits
// 30s with the default ladder): choose tiers near the delays your Retry
// layer asks for.
//
// The handler sees a message as it was first delivered, on every attempt
// and after a replay: a delivery that comes back from a delay queue (or is
// replayed from the dead-letter queue) through the default exchange gets
// back its original Exchange and RoutingKey (HeaderOriginalExchange,
// HeaderOriginalRoutingKey) and the properties its copies keep in headers,
// before the first layer runs. So a handler that branches on the routing
// key does the same on every attempt, and Log, otelmw and the fault
// headers name the original.
//
// # Acks
//
// Acks are coalesced: once every delivery received before it on its
// channel is settled, one ack with multiple set settles the run. An ack
// waits at most 10 ms for others to join it; one behind a delivery still
// in its handler is then sent alone. The acks kept count against the
// prefetch window as unsettled deliveries do, so they are kept only in
// the part of it beyond the workers (ConsumeOptions.Prefetch minus
// Workers): at most three quarters of that part, and 32; when they reach
// that, the run is sent, and then as many of the acks behind a gap as it
// takes, one by one, the highest first. With a prefetch count at most two
// above the workers, where three quarters of that part is less than two,
// each ack is sent as it comes. Acks not sent yet when a connection is
// lost are lost with it, as an ack written just before it dies is: the server
// redelivers those messages (at most as many as the acks kept), and Dedup
// takes them for duplicates.
//
// # Copies that fail
//
// The original of a copy is settled only once the copy's fate is known. If
// the server refuses the copy (unroutable, or nacked), the original is
// nacked with requeue after a pause of about a second: a message is never
// lost for a failed settlement, and never requeued in a hot loop. A copy
// that can never be sent (ErrInvalidMessage: too big for a frame with the
// headers it adds) is not tried again: a delayed message is dead-lettered
// instead, and a dead-letter copy is sent with its fault headers cut
// short or, if even that does not fit, the original is rejected to the
// work queue's dead-letter exchange, and the reason logged at Error. If the
// copy's fate cannot be known, because the connection is lost before its
// confirm, or the confirm has not come two minutes after the copy was sent
// (Consume then gives the connection up, and connects again), the original
// is left to the server, which redelivers it: the message then exists
// twice, as the original and as its copy. That is the one window in which
// Consume duplicates a message; Dedup absorbs the second.
//
// A panic that escapes the handler becomes
// rabbitmw.Permanent(&rabbitmw.PanicError{...}): the message is
// dead-lettered, the panic logged at Error, and the process goes on.
//
// # Reconnection
//
// When the connection or a channel is lost (a server's consumer_timeout
// closes the channel too), [Broker.Consume] connects again at once, with
// backoff (Options.ReconnectMin/Max, starting again from the minimum once
// a connection is consuming), declares again and resumes. Handlers still
// running on the lost connection finish in the background: their
// deliveries cannot be settled any more, the server redelivers them, and
// Dedup absorbs the redeliveries. They keep their worker until they
// return: at most ConsumeOptions.Workers handlers run at once, whatever
// connection their deliveries came on. A delivery received on a connection
// that has since closed is not handled. Each state change is logged.
//
// # Shutdown
//
// When its context is cancelled, Consume stops taking deliveries
// (basic.cancel), requeues the ones received but not started (if those
// writes have not ended five seconds later, on a socket the server no
// longer reads, it sends the acks not sent yet, as below, and closes the
// connection, which ends them: the server requeues what was not settled,
// and the handlers in flight can no longer settle theirs), lets the
// handlers in flight finish and settles them, then closes its connection,
// after the acks not sent yet (an ack whose write has not ended five
// seconds later, on a socket the server no longer reads, is lost with the
// connection), and returns nil.
//
// Handlers, those of lost connections included, run with a context that
// is cancelled only when ConsumeOptions.ShutdownTimeout has passed after
// Consume's context was cancelled. A result that comes after that deadline
// is still settled, once, under a context of its own that lasts two
// seconds: no copy is published under a context that is done. A handler
// whose own code has returned may still be in its layers, writing its
// result to their store (the done mark and release of middleware.Dedup,
// the failure count of middleware.Retry, the commit of pgstore's inbox)
// under a context the cancellation does not end: Consume waits for those
// writes until their own deadlines (for a done mark, the end of the
// claim's lease), since a done mark lost when the process exits lets the
// message's effect repeat. If some handlers have still not returned a
// second after the deadline, and after those writes, Consume
// waits up to two seconds more for the settlements in progress, closes the
// connection (the server requeues the messages of the handlers still
// running) and returns an error wrapping ErrShutdownTimeout that says how
// many. Those handlers' goroutines end when the handlers return; their
// results are not settled. Every other goroutine of Consume has ended when
// it returns. A fatal error ends Consume the same way, after the same wait
// for the handlers in flight. A socket the server no longer reads delays
// Consume's return by at most about twenty seconds past ShutdownTimeout;
// a store that does not answer the writes above, by at most their
// deadlines.
//
// # Fatal errors
//
// Consume returns on a fatal error: wrong credentials (ErrAccessRefused),
// a missing queue (ErrQueueNotFound), a work queue with other arguments
// (ErrQueueArguments), a consumer cancelled by the server, as when its
// queue is deleted (ErrConsumerCancelled), invalid options. A server that
// cannot be reached is not fatal: Consume logs it and keeps trying until
// its context is done, and then returns nil.
//
// # Guarantees and their limits
//
// Nothing is lost by the broker: a delivery is acked only after it was
// handled, or after its copy was confirmed by the server; a delivery whose
// connection was lost is redelivered by the server. Deliveries are
// therefore at least once, and a handler may see a message again: after a
// lost connection (the handler's result could not be settled, or its ack,
// coalesced with others, was not sent yet), after a lost confirm on
// publish, or, rarely, as a second copy:
//
//   - if the connection drops between the sending of a copy (delayed or
//     dead-lettered) and the ack of its original, whether the copy was
//     confirmed or its confirm was still on its way, the original is
//     redelivered and the copy may exist too: the dead-letter queue may
//     then hold a second copy, and a retried message may run twice. The
//     same holds for a copy whose confirm has not come after two minutes
//     (Consume then gives the connection up), and for one still waiting
//     for its confirm when a shutdown gives up on its handlers;
//   - Publish retries after a lost connection, and the first copy may have
//     reached its queue.
//
// Use the Dedup layer (message ids) to make the effects once. Delay queues
// are classic queues whose dead-lettering back to Q is at-most-once inside
// RabbitMQ: a delayed message can be lost if a RabbitMQ node fails while it
// moves. Messages in delay queues wait in order: the TTL of a queue is
// fixed, so none blocks another.
//
// A handler that never returns holds a worker and a prefetch slot; at
// shutdown Consume gives up on it after ConsumeOptions.ShutdownTimeout and
// reports it. A handler still running when its connection is lost keeps
// its worker, but not the consumer: Consume connects again at once, and
// the other workers go on. A handler's panic never crashes the process.
//
// # Publishing
//
// [Broker.Publish] uses publisher confirms and the mandatory flag: it
// returns when the server confirmed the message, and an error for a
// message that reached no queue (ErrUnroutable) or that the server refused
// (ErrNacked). Messages are persistent unless the caller says otherwise,
// and get a random MessageId when they have none. A message that cannot
// be sent as it is (a property over 255 bytes, a header amqp091 cannot
// send or read back, headers too big for a frame, a CC or BCC header that
// is not an array of strings) is refused at once with
// ErrInvalidMessage, and the connection is left alone.
//
// A nack is returned to its caller, and the connection goes on; the
// channel that was nacked does not. RabbitMQ 3.10 can nack every publish
// of a channel that published to a quorum queue whose leader died, for
// 30 s and more after a new leader is elected, while a new channel's
// publishes are confirmed at once. So a connection replaces its publish
// channel with a new one, before its next publish, once the server
// nacked a publish on it: at most once a second, and only after the
// channel replaced before has received the confirms of all its publishes
// (their results are their own: no nacked publish is reported
// confirmed). The log says so, at Info ("publish channel replaced"), and
// so does Observer.PublishChannel (which otelmw counts). A
// queue that refuses publishes for a reason of its own (at its length
// limit with overflow reject-publish) thus costs a new channel a second
// at most. The consume channel, and the deliveries it holds, are never
// touched; the delay and dead-letter copies of a consumer go through the
// same publish channel, and are replaced with it.
//
// # The dead-letter queue
//
// Package [github.com/rabbitmw/rabbitmw/broker/deadletter] works on Q.dlq:
// it lists its messages without changing it, sends them back to their
// work queue once their cause is fixed, removes them, and saves them to
// JSON Lines and back. The command cmd/rabbitmw does the same from a
// shell.
//
// # In-memory server
//
// Package [github.com/rabbitmw/rabbitmw/broker/brokertest] emulates the
// parts of RabbitMQ the broker uses, as net/http/httptest serves HTTP:
// New(srv.URL(), opts) connects to it, and tests and the examples run the
// same consumer on it, reconnection included.
package broker
