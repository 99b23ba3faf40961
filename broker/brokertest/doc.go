// Package brokertest provides an in-process RabbitMQ server for tests of
// code that uses package broker, and for examples that need no setup, as
// net/http/httptest provides an HTTP server:
//
//	srv := brokertest.NewServer()
//	defer srv.Close()
//	b := broker.New(srv.URL(), broker.Options{})
//	defer b.Close()
//
// The Broker runs the same code on a Server as on RabbitMQ: the consumer,
// its settlement and its reconnection are not doubles. Only the server is.
//
// # What a Server models
//
// It emulates what package broker relies on, as RabbitMQ 3.10 does it:
//
//   - the default exchange (a message published with routing key K goes
//     to queue K), and exchanges of kind direct, topic, fanout and headers
//     with their bindings; a publish to a missing exchange, or one that
//     reaches no queue, is returned as unroutable (broker.ErrUnroutable),
//     and one to an internal exchange is refused (403);
//   - sender-selected distribution: the strings of the CC and BCC headers
//     (arrays of strings; a header of another type, or an element that is
//     not a string, is refused before it is sent, as on RabbitMQ:
//     broker.ErrInvalidMessage) route a message as its routing key does,
//     BCC is removed before delivery, and dead-lettering through a queue's
//     x-dead-letter-routing-key removes CC;
//   - publisher confirms, at once or after a delay (Server.SetConfirmDelay);
//   - durable queues with the arguments x-queue-type ("quorum" or
//     "classic"), x-message-ttl, x-dead-letter-exchange (the default
//     exchange ""), x-dead-letter-routing-key, x-delivery-limit,
//     x-single-active-consumer (the longest registered consumer gets
//     every message), x-dead-letter-strategy and x-overflow (accepted
//     and compared; with no length limit and no node to lose, every
//     value behaves alike);
//     redeclaring with other arguments fails with 406 PRECONDITION_FAILED,
//     a passive declare of a missing queue with 404 NOT_FOUND;
//   - dead-lettering on expiry at the head of a queue (by its TTL or the
//     message's Expiration, its per-message TTL in milliseconds), on a
//     reject or nack without requeue, and past a quorum queue's delivery
//     limit, with the x-death, x-first-death-queue, x-first-death-reason
//     and x-first-death-exchange headers as RabbitMQ writes them, and
//     without the message's Expiration (kept in its x-death record as
//     original-expiration), so that it does not expire again; a message
//     that would circle through dead-lettering with no reject on the way is
//     dropped, by RabbitMQ 3.10's cycle rule;
//   - per-consumer prefetch, delivery tags per connection, ack, nack and
//     reject (multiple too), Redelivered on a returned message, an
//     x-delivery-count header on quorum queues; a settlement with an unknown
//     tag closes the connection (406), as RabbitMQ closes the channel;
//   - on a connection's close, its unsettled deliveries return to their
//     queues; deleting a queue cancels its consumers (basic.cancel);
//   - header values and timestamps as the wire carries them (int becomes
//     int32, times lose their fractions of a second), and a publish whose
//     UserId is not "guest", the server's only user, is refused;
//   - a frame_max of 128 KiB, RabbitMQ's default; a message that amqp091
//     or RabbitMQ could not carry is refused as on RabbitMQ
//     (broker.ErrInvalidMessage).
//
// Delivered messages are real amqp.Delivery values whose Acknowledger is
// the Server's connection: settling one after its connection closed
// returns amqp.ErrClosed.
//
// # Where it differs from RabbitMQ
//
// Plugins' exchange kinds, exchange-to-exchange bindings, alternate
// exchanges, auto-deleting exchanges (they stay), persistence, queue
// length limits (and so nacked publishes), virtual hosts, users other than
// "guest" and permissions are not emulated. A connection has a single channel: a
// refusal that closes a channel on RabbitMQ closes the whole connection
// here, which the broker handles as it does the loss of either. Heartbeats
// do not apply (broker.Options.Heartbeat is unused). Expiry is exact to
// the clock: a message expires at its deadline, where RabbitMQ may take a
// moment more. A Server made in a testing/synctest bubble runs there, its
// TTLs and confirm delays on the bubble's clock; it must then be used only
// from that bubble.
//
// # Hooks for tests
//
// CloseConnections cuts every connection, as `rabbitmqctl
// close_all_connections` does; SetDown makes the server refuse
// connections; SetConfirmDelay slows its confirms. Stats and Unacked read
// its counters, for checks that RabbitMQ cannot offer: how many
// connection attempts it saw, how many ack frames settled how many
// deliveries, how many settlements used an unknown tag.
//
// A Server is reachable only from its own process, by the URL it was
// given: broker.New recognises the "memory://" scheme.
package brokertest
