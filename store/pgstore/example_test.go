package pgstore_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// The transactional inbox: the charge and the message's done mark commit
// in one transaction, beneath the recommended stack over the same store.
// The message comes twice; the charge is made once.
func ExampleHandler() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL") // your database
	if url == "" {
		url = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	// Tables of this example's own (in production: the defaults, and
	// charges is yours).
	const inbox, charges = "rmwexample_inbox", "rmwexample_charges"
	defer pool.Exec(ctx, `DROP TABLE IF EXISTS `+inbox+`, `+inbox+`_failures, `+charges)
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+charges+` (order_id text PRIMARY KEY, amount int)`); err != nil {
		log.Fatal(err)
	}

	st := pgstore.New(pool, pgstore.Options{Table: inbox})
	defer st.Close()
	if err := st.Migrate(ctx); err != nil { // or st.Check, if you migrate yourself
		log.Fatal(err)
	}
	charge := pgstore.Handler(st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+charges+` (order_id, amount) VALUES ($1, 42)`, d.MessageId)
		return err // nil: the insert and the done mark commit together
	}, pgstore.HandlerOptions{})
	h := middleware.Stack(st, middleware.StackOptions{})(charge)

	rec := rabbitmwtest.NewRecorder() // in production: broker.Consume(ctx, "orders", h, …)
	for range 2 {
		err := h.Handle(ctx, rec.Deliver(amqp.Publishing{MessageId: "order-1"}))
		fmt.Printf("%v: %v\n", rabbitmw.Decide(err).Outcome, err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+charges).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("charges:", n)
	// Output:
	// acked: <nil>
	// duplicate: middleware: dedup: key "order-1": rabbitmw: duplicate delivery
	// charges: 1
}
