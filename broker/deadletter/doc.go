// Package deadletter works on the dead-letter queues of package broker's
// topology, beside the consumers that fill them, as an operator does: an
// [Inspector] lists the messages of a work queue's dead-letter queue
// without changing it ([Inspector.List]), sends them back to their work
// queue once their cause is fixed ([Inspector.Replay]), removes them
// ([Inspector.Purge]), and saves them to JSON Lines and back
// ([Inspector.Export], [Inspector.Import]). Each selects messages with a
// [Filter], and each reads the queue on a connection of its own, leaving
// the Broker's consumers and publishers alone.
//
// A [Message] describes a dead-lettered message as read from the fault
// headers that package broker writes on its dead-letter copies (see
// [broker.HeaderError] and the others) and from the records RabbitMQ adds
// when it dead-letters a message itself. A replayed copy carries the
// fault headers of its earlier lives in [HeaderHistory].
//
// The command cmd/rabbitmw does the same from a shell.
package deadletter
