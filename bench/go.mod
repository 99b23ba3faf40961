module github.com/rabbitmw/rabbitmw/bench

go 1.26.0

require (
	github.com/rabbitmq/amqp091-go v1.16.0
	github.com/rabbitmw/rabbitmw v0.0.0
	github.com/redis/go-redis/v9 v9.23.0
)

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	go.uber.org/atomic v1.12.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
)

// The bench measures the library of this repository, as it is checked out.
replace github.com/rabbitmw/rabbitmw => ../
