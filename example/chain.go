package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/pgstore/relay"
)

// The chain, with -postgres: service A consumes orders with the PostgreSQL
// inbox and, in the same transaction, writes a shipment request into the
// outbox; a relay sends the outbox to RabbitMQ; service B consumes the
// shipments with its own inbox. Some orders are published twice, and the
// first attempt of one order fails after its outbox write, so that its
// transaction, and the message in it, roll back.

const (
	chainOrders    = 10
	chainDuplicate = 3         // orders 1..3 are published twice
	chainFails     = "order-7" // fails once, after its outbox write
)

type chainReport struct {
	deliveries          int               // to A
	aEffects, bEffects  map[string]int    // order -> effects
	shipmentIDs         map[string]string // order -> the message id B saw
	rolledBack          string            // the message id of the rolled-back write
	rolledBackDelivered bool
	stats               pgstore.OutboxStats
}

func (r *chainReport) ok() bool {
	if r.rolledBack == "" || r.rolledBackDelivered || r.stats.Pending != 0 || r.stats.Parked != 0 {
		return false
	}
	for i := 1; i <= chainOrders; i++ {
		o := fmt.Sprintf("order-%d", i)
		if r.aEffects[o] != 1 || r.bEffects[o] != 1 {
			return false
		}
	}
	return true
}

func (r *chainReport) print(w io.Writer) {
	fmt.Fprintf(w, "the outbox chain: A (inbox + outbox) → relay → B (inbox)\n")
	fmt.Fprintf(w, "  %d orders published, %d of them twice: %d deliveries to A\n", chainOrders, chainDuplicate, r.deliveries)
	for i := 1; i <= chainOrders; i++ {
		o := fmt.Sprintf("order-%d", i)
		note := ""
		if o == chainFails {
			note = fmt.Sprintf("  (its first transaction rolled back after writing shipment %s: never sent)", r.rolledBack)
		}
		fmt.Fprintf(w, "  %-9s effects in A: %d, shipment %s, effects in B: %d%s\n", o, r.aEffects[o], r.shipmentIDs[o], r.bEffects[o], note)
	}
	fmt.Fprintf(w, "  outbox: %d sent, %d pending, %d parked\n", r.stats.Sent, r.stats.Pending, r.stats.Parked)
	verdict := "OK: each order took effect once in A and once in B, and the rolled-back message never left"
	if !r.ok() {
		verdict = "FAILED: see above"
	}
	fmt.Fprintln(w, verdict)
}

func runChain(ctx context.Context, cfg config) (*chainReport, error) {
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	runID := randomHex(4)
	prefix := "rabbitmw_example_" + runID
	orders, shipments := "rabbitmw-example-orders-"+runID, "rabbitmw-example-shipments-"+runID

	b, closeBroker, err := openBroker(cfg, broker.Observer{})
	if err != nil {
		return nil, err
	}
	defer closeBroker()
	pool, err := pgxpool.New(ctx, cfg.postgresURL)
	if err != nil {
		return nil, fmt.Errorf("-postgres: %w", err)
	}
	defer pool.Close()
	drop := []string{prefix + "_outbox", prefix + "_a_effects", prefix + "_b_effects"}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, t := range drop {
			pool.Exec(ctx, `DROP TABLE IF EXISTS `+t)
		}
	}()
	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: prefix + "_outbox"})
	if err := ob.Migrate(ctx); err != nil {
		return nil, err
	}
	stores := map[string]*pgstore.Store{}
	for _, s := range []string{"a", "b"} {
		st := pgstore.New(pool, pgstore.Options{Table: prefix + "_" + s})
		defer st.Close()
		drop = append(drop, prefix+"_"+s, prefix+"_"+s+"_failures")
		if err := st.Migrate(ctx); err != nil {
			return nil, err
		}
		stores[s] = st
	}
	for _, ddl := range []string{
		`CREATE TABLE ` + prefix + `_a_effects (order_id text NOT NULL)`,
		`CREATE TABLE ` + prefix + `_b_effects (order_id text NOT NULL, message_id text NOT NULL)`,
	} {
		if _, err := pool.Exec(ctx, ddl); err != nil {
			return nil, err
		}
	}
	topo := broker.Topology{Delays: delayTiers}
	for _, q := range []string{orders, shipments} {
		if err := b.Declare(ctx, q, topo); err != nil {
			return nil, err
		}
		defer b.Delete(context.WithoutCancel(ctx), q, topo)
	}

	rep := &chainReport{aEffects: map[string]int{}, bEffects: map[string]int{}, shipmentIDs: map[string]string{}}
	var mu sync.Mutex
	stack := func(st *pgstore.Store, name string) rabbitmw.Middleware {
		return middleware.Stack(st, middleware.StackOptions{Logger: cfg.logger.With("service", name), Retry: middleware.RetryOptions{Backoff: backoff}})
	}
	// Service A: the order's effect and the shipment request, one commit.
	a := stack(stores["a"], "A")(pgstore.Handler(stores["a"], func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		order := string(d.Body)
		if _, err := tx.Exec(ctx, `INSERT INTO `+prefix+`_a_effects (order_id) VALUES ($1)`, order); err != nil {
			return err
		}
		id, err := ob.Write(ctx, tx, "", shipments, amqp.Publishing{ContentType: "text/plain", Body: d.Body})
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		if order == chainFails && rep.rolledBack == "" {
			rep.rolledBack = id
			return errors.New("the warehouse is closed: fails after the outbox write, once")
		}
		return nil
	}, pgstore.HandlerOptions{RetryDelay: 200 * time.Millisecond}))
	// Service B: the shipment's effect.
	bh := stack(stores["b"], "B")(pgstore.Handler(stores["b"], func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+prefix+`_b_effects (order_id, message_id) VALUES ($1, $2)`, string(d.Body), d.MessageId)
		return err
	}, pgstore.HandlerOptions{RetryDelay: 200 * time.Millisecond}))
	counted := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		mu.Lock()
		rep.deliveries++
		mu.Unlock()
		return a.Handle(ctx, d)
	})

	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for _, f := range []func() error{
		func() error {
			return b.Consume(runCtx, orders, counted, broker.ConsumeOptions{Workers: 4, Topology: topo, ConsumerTag: "example-A"})
		},
		func() error {
			return b.Consume(runCtx, shipments, bh, broker.ConsumeOptions{Workers: 4, Topology: topo, ConsumerTag: "example-B"})
		},
		func() error {
			return relay.New(ob, b, relay.Options{Logger: cfg.logger.With("service", "relay"), PollInterval: 200 * time.Millisecond}).Run(runCtx)
		},
	} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := f(); err != nil {
				errs <- err
			}
		}()
	}
	defer func() { stop(); wg.Wait() }()

	for i := 1; i <= chainOrders+chainDuplicate; i++ {
		n := i
		if i > chainOrders {
			n = i - chainOrders // a copy of an order published before
		}
		o := fmt.Sprintf("order-%d", n)
		if err := b.Publish(ctx, "", orders, amqp.Publishing{MessageId: o, Body: []byte(o)}); err != nil {
			return nil, err
		}
	}

	count := func() (int, error) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(DISTINCT order_id) FROM `+prefix+`_b_effects`).Scan(&n)
		return n, err
	}
	for {
		n, err := count()
		if err != nil {
			return nil, err
		}
		if n == chainOrders {
			break
		}
		select {
		case err := <-errs:
			return nil, err
		case <-ctx.Done():
			return nil, fmt.Errorf("the chain: %d of %d orders shipped when the time ran out", n, chainOrders)
		case <-time.After(50 * time.Millisecond):
		}
	}
	time.Sleep(300 * time.Millisecond) // a late copy, if any, would arrive by now
	stop()
	wg.Wait()

	read := func(q string, f func(order, id string)) error {
		rows, err := pool.Query(context.WithoutCancel(ctx), q)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var order, id string
			if err := rows.Scan(&order, &id); err != nil {
				return err
			}
			f(order, id)
		}
		return rows.Err()
	}
	if err := read(`SELECT order_id, '' FROM `+prefix+`_a_effects`, func(o, _ string) { rep.aEffects[o]++ }); err != nil {
		return nil, err
	}
	if err := read(`SELECT order_id, message_id FROM `+prefix+`_b_effects`, func(o, id string) {
		rep.bEffects[o]++
		rep.shipmentIDs[o] = id
		if id == rep.rolledBack {
			rep.rolledBackDelivered = true
		}
	}); err != nil {
		return nil, err
	}
	rep.stats, err = ob.Stats(context.WithoutCancel(ctx))
	return rep, err
}
