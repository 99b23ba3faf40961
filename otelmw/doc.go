// Package otelmw traces and measures rabbitmw's consumers and publishers
// with OpenTelemetry, following the messaging semantic conventions.
//
// It depends on the OpenTelemetry API alone; the SDK and the exporters are
// the application's choice. Nothing else in rabbitmw imports it, so a
// program that does not links no OpenTelemetry.
//
// A [Telemetry] serves the consumers of one queue, which Options.Queue
// names (a delivery does not), and any number of publishers. Wire it in
// three places: its layer first in the chain, its Dedup observer in the
// Dedup layer (DedupOptions.Observe, StackOptions.Dedup.Observe), and its broker observer in the
// Broker:
//
//	tel := otelmw.New(otelmw.Options{Queue: "orders"})
//	b := broker.New(url, broker.Options{Observer: tel.Broker()})
//	chain := rabbitmw.Chain(
//		tel.Middleware(),
//		middleware.Stack(s, middleware.StackOptions{Logger: logger, Dedup: middleware.DedupOptions{Observe: tel.Dedup()}}),
//	)
//
// Then a message's trace holds the producer's "send orders" span and, as
// its children (or linked roots, with Options.NewRoot), one "process
// orders" span per attempt: the broker's delay and dead-letter copies
// keep the headers the publish injected, so every retry and the
// dead-letter link back to the publish. Dedup's answer and the lease
// renewals are events of the attempt's span.
//
// The metrics are the conventions' messaging.process.duration,
// messaging.client.consumed.messages and messaging.client.sent.messages,
// and rabbitmw's own: rabbitmw.handlers.active, rabbitmw.message.attempts,
// rabbitmw.dedup.results, rabbitmw.dedup.lease.renewals,
// rabbitmw.dedup.leases.lost, rabbitmw.dead_letters,
// rabbitmw.delay.republishes, rabbitmw.reconnects and
// rabbitmw.publish_channel.replacements; [Telemetry.WatchQueues]
// reports the depth of the queues, rabbitmw.queue.depth and
// rabbitmw.dead_letter.oldest.age. Each method's
// documentation says which it records and with what attributes.
package otelmw
