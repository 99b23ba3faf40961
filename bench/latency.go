package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker"
)

// latencyContenders run under -latency when -only is not given.
var latencyContenders = []string{plainName, redisName, redisUnbatchedName}

// runLatency measures, for each contender, the time from publishing a
// message to its ack at a light load: the consumer runs first on an empty
// queue, and -n messages are published one at a time at -rate per second,
// so that batching shows what it costs when there is nothing to batch.
func runLatency(ctx context.Context, e *env, cfg config, prefetch, workers int) error {
	names := cfg.only
	if len(names) == 0 {
		names = latencyContenders
	}
	fmt.Printf("publish-to-ack latency: %d messages per contender at %d msgs/s, prefetch %d, workers %d\n\n", cfg.n, cfg.rate, prefetch, workers)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "contender\tround\tp50\tp90\tp99\tmax\tacked\t")
	for round := 1; round <= cfg.rounds; round++ {
		for _, name := range inRoundOrder(names, round) {
			c := newContender(name, prefetch, workers, broker.ConsumeOptions{Prefetch: cfg.prefetch, Workers: cfg.workers})
			lat, err := e.latencyRun(ctx, c, fmt.Sprintf("lat.%s.r%d", name, round))
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			slices.Sort(lat)
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%d\t\n", name, round,
				fmtMicros(micros(percentile(lat, 50))), fmtMicros(micros(percentile(lat, 90))),
				fmtMicros(micros(percentile(lat, 99))), fmtMicros(micros(percentile(lat, 100))), len(lat))
			tw.Flush()
		}
	}
	return nil
}

// latencyRun runs c in a child that notes when each ack was sent, while
// this process publishes at -rate and notes when each message was sent.
func (e *env) latencyRun(ctx context.Context, c contender, label string) (lat []int64, err error) {
	ids, _ := messageIDs(e.cfg.n, 0, 0)
	b := batch{queue: e.runID + "." + label, prefix: e.runID + ":" + label + ":", ids: ids, unique: len(ids)}
	defer func() {
		if derr := e.drop(b); derr != nil {
			err = errors.Join(err, fmt.Errorf("clean up: %w", derr))
		}
	}()
	if err := e.admin.Declare(ctx, b.queue, topology); err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, e.cfg.timeout+time.Minute)
	defer cancel()
	child, _, err := startChild(rctx, e.childSpec(c, b, true))
	if err != nil {
		return nil, err
	}
	defer child.stop()
	if err := child.start(); err != nil {
		return nil, err
	}
	ch, err := e.channel()
	if err != nil {
		return nil, err
	}
	defer ch.Close()
	mode := amqp.Transient
	if e.cfg.persistent {
		mode = amqp.Persistent
	}
	body := make([]byte, e.cfg.size)
	if err := waitConsumer(rctx, ch, b.queue); err != nil {
		return nil, err
	}
	pubAt := make([]int64, len(ids))
	interval := time.Second / time.Duration(e.cfg.rate)
	t0 := time.Now()
	for i, id := range ids {
		if d := time.Until(t0.Add(time.Duration(i) * interval)); d > 0 {
			time.Sleep(d)
		}
		pubAt[i] = time.Now().UnixNano()
		if err := ch.PublishWithContext(rctx, "", b.queue, false, false, amqp.Publishing{
			MessageId: id, DeliveryMode: mode, ContentType: "application/octet-stream", Body: body,
		}); err != nil {
			return nil, err
		}
	}
	var done childDone
	if err := child.read("done", &done); err != nil {
		return nil, err
	}
	var res childResult
	if err := child.read("result", &res); err != nil {
		return nil, err
	}
	if res.Err != "" {
		return nil, errors.New(res.Err)
	}
	for i, at := range res.AckAt {
		if at > 0 && i < len(pubAt) {
			lat = append(lat, at-pubAt[i])
		}
	}
	return lat, nil
}

// waitConsumer waits until queue has a consumer, so that no message waits
// in the queue for the consumer to start.
func waitConsumer(ctx context.Context, ch *amqp.Channel, queue string) error {
	for {
		q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
		if err != nil {
			return err
		}
		if q.Consumers > 0 {
			time.Sleep(100 * time.Millisecond) // the consumer's other workers, and its Redis connections
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
