package broker

import "github.com/rabbitmw/rabbitmw/broker/internal/transport"

// Everything above a transport.Session (reconnecting, topology,
// settlement, shutdown) is written once, here, for both servers: RabbitMQ
// over AMQP (amqpTransport) and the in-memory server of package
// brokertest, which New finds by its URL (transport.Lookup).
type (
	session    = transport.Session
	queueSpec  = transport.QueueSpec
	queueError = transport.QueueError

	exchangeSpec  = transport.ExchangeSpec
	bindingSpec   = transport.BindingSpec
	exchangeError = transport.ExchangeError
)
