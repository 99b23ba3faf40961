package pgstore_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// A connection that swallows the COMMIT it is asked to send, once armed:
// the server never answers, as when the network drops it.
type commitSwallower struct {
	net.Conn
	armed *atomic.Bool
}

func (c commitSwallower) Write(b []byte) (int, error) {
	if len(b) > 0 && b[0] == 'Q' && bytes.Contains(bytes.ToLower(b), []byte("commit")) && c.armed.CompareAndSwap(true, false) {
		return len(b), nil
	}
	return c.Conn.Write(b)
}

// HandlerOptions.CommitTimeout "bounds the commit", and SQLHandler says
// everything Handler says holds for it; but sqlTxn.commit drops its
// context and the transaction's context has no deadline (BeginTx gets
// context.WithoutCancel), so a commit whose answer never comes holds the
// delivery, its worker and its row lock forever.
func TestReviewCommitTimeoutBoundsTheCommit(t *testing.T) {
	ctx := context.Background()
	base := newPool(t)
	cfg := base.Config()
	var armed atomic.Bool
	var mu sync.Mutex
	var conns []net.Conn
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
		return commitSwallower{c, &armed}, nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	f := newInbox(t, pool)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	t.Cleanup(func() { // unblocks a commit still waiting
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	opts := pgstore.HandlerOptions{CommitTimeout: 200 * time.Millisecond}
	for _, tt := range []struct {
		name string
		h    rabbitmw.Handler
	}{
		{"Handler", pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
			armed.Store(true)
			return f.insert(ctx, tx, d)
		}, opts)},
		{"SQLHandler", pgstore.SQLHandler(f.st, db, func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error {
			armed.Store(true)
			_, err := tx.ExecContext(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId)
			return err
		}, opts)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := rabbitmw.Chain(middleware.Dedup(f.st, middleware.DedupOptions{}))(tt.h)
			done := make(chan error, 1)
			go func() { done <- h.Handle(ctx, delivery("m-"+tt.name)) }()
			select {
			case err := <-done:
				if !errors.Is(err, middleware.ErrStoreUnavailable) {
					t.Errorf("Handle = %v; want ErrStoreUnavailable (the commit's answer was lost)", err)
				}
			case <-time.After(15 * time.Second): // waits for the real server's (non-)answer
				t.Errorf("Handle still waiting on its commit 15 s after it was sent, with CommitTimeout %v", opts.CommitTimeout)
			}
		})
	}
}
