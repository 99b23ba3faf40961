package transport

import (
	"fmt"
	"math"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/internal/expiration"
	"github.com/rabbitmw/rabbitmw/internal/header"
	"github.com/rabbitmw/rabbitmw/internal/text"
)

// What a message may carry. AMQP 0-9-1 writes names, the short-string
// properties and table keys as short strings. A message's properties and
// headers travel in one frame, which amqp091's reader takes only if it
// fits in the negotiated frame_max less a frame's header and end; it also
// refuses tables and arrays nested deeper than maxNesting or holding more
// than maxEntries. A message beyond these limits either is refused by
// amqp091 as it writes it, or closes the connection of the server or of
// every consumer it is delivered to: it must never be sent.
const (
	maxShortString = 255
	maxNesting     = 32
	maxEntries     = 8192
)

// FrameOverhead is a frame's header (7 bytes) and end (1).
const FrameOverhead = 8

// CheckPublishing checks that a publish of msg to exchange with routing key
// key can be sent, and read back by amqp091: names and short-string
// properties of at most 255 bytes, and headers of the types amqp091 sends,
// with names of at most 255 bytes, nested and sized within what it reads;
// and that RabbitMQ takes it as written: an Expiration it reads, CC and
// BCC headers that are arrays of strings (see header.CheckSenderKeys).
// It returns the size of the frame payload that will carry msg's properties
// and headers, for FitFrame, or an error wrapping ErrInvalidMessage that
// names the field and the limit.
func CheckPublishing(exchange, key string, msg amqp.Publishing) (size int, err error) {
	size = 2 + 2 + 8 + 2 // class, weight, body size, property flags
	for _, p := range [...]struct {
		name, v string
		prop    bool
	}{
		{"exchange", exchange, false},
		{"routing key", key, false},
		{"ContentType", msg.ContentType, true},
		{"ContentEncoding", msg.ContentEncoding, true},
		{"CorrelationId", msg.CorrelationId, true},
		{"ReplyTo", msg.ReplyTo, true},
		{"Expiration", msg.Expiration, true},
		{"MessageId", msg.MessageId, true},
		{"Type", msg.Type, true},
		{"UserId", msg.UserId, true},
		{"AppId", msg.AppId, true},
	} {
		if len(p.v) > maxShortString {
			return 0, fmt.Errorf("%w: %s is %d bytes; an AMQP short string holds at most %d", ErrInvalidMessage, p.name, len(p.v), maxShortString)
		}
		if p.prop && p.v != "" {
			size += 1 + len(p.v)
		}
	}
	if err := expiration.Check(msg.Expiration); err != nil {
		return 0, fmt.Errorf("%w: %w", ErrInvalidMessage, err)
	}
	if msg.DeliveryMode != 0 {
		size++
	}
	if msg.Priority != 0 {
		size++
	}
	if !msg.Timestamp.IsZero() {
		size += 8
	}
	if len(msg.Headers) > 0 {
		if err := header.CheckSenderKeys(msg.Headers); err != nil {
			return 0, fmt.Errorf("%w: header %w", ErrInvalidMessage, err)
		}
		n, fe := tableSize(msg.Headers, 0)
		if fe != nil {
			return 0, fmt.Errorf("%w: header %s: %s", ErrInvalidMessage, fe.path, fe.why)
		}
		size += n
	}
	return size, nil
}

// FitFrame checks that properties and headers of size bytes (from
// CheckPublishing) fit in a frame of a connection whose frames carry at
// most limit bytes (0: no limit), leaving headroom bytes free.
func FitFrame(size, limit, headroom int) error {
	if limit <= 0 || size <= limit-headroom {
		return nil
	}
	if headroom == 0 {
		return fmt.Errorf("%w: its properties and headers take %d bytes; a frame of this server (frame_max %d) holds %d",
			ErrInvalidMessage, size, limit+FrameOverhead, limit)
	}
	return fmt.Errorf("%w: its properties and headers take %d bytes; at most %d may be sent, to leave %d KiB of a frame (frame_max %d) for the headers added when it is retried or dead-lettered",
		ErrInvalidMessage, size, limit-headroom, headroom>>10, limit+FrameOverhead)
}

// A fieldError says which header field cannot be sent, and why. path is
// built as the error goes up the tables: "a"."b"[2].
type fieldError struct {
	path string
	why  string
}

func (e *fieldError) under(seg string) *fieldError {
	if e.path != "" && e.path[0] != '[' {
		seg += "."
	}
	e.path = seg + e.path
	return e
}

// quoteName quotes a table key for an error, cut short if it is long.
func quoteName(k string) string { return strconv.Quote(text.Truncate(k, 40)) }

// tableSize returns the size of t as amqp091 writes it in a field table,
// its length included, or why it cannot be sent. depth is t's nesting: 0
// for a message's headers.
func tableSize(t amqp.Table, depth int) (int, *fieldError) {
	if depth > maxNesting {
		return 0, &fieldError{why: fmt.Sprintf("tables and arrays nest %d deep here; amqp091 reads at most %d", depth, maxNesting)}
	}
	if len(t) > maxEntries {
		return 0, &fieldError{why: fmt.Sprintf("the table holds %d entries; amqp091 reads at most %d", len(t), maxEntries)}
	}
	size := 4
	for k, v := range t {
		if len(k) > maxShortString {
			return 0, &fieldError{path: quoteName(k), why: fmt.Sprintf("the name is %d bytes; an AMQP short string holds at most %d", len(k), maxShortString)}
		}
		n, fe := fieldSize(v, depth)
		if fe != nil {
			return 0, fe.under(quoteName(k))
		}
		size += 1 + len(k) + n
	}
	return size, nil
}

// fieldSize returns the size of v as amqp091 writes it in a table or
// array of nesting depth, its type octet included, or why it cannot be
// sent.
func fieldSize(v any, depth int) (int, *fieldError) {
	switch x := v.(type) {
	case nil:
		return 1, nil
	case bool, int8, uint8:
		return 2, nil
	case int16, uint16:
		return 3, nil
	case int32, uint32, float32:
		return 5, nil
	case int:
		if x < math.MinInt32 || x > math.MaxInt32 {
			return 0, &fieldError{why: fmt.Sprintf("the int %d does not fit the 32-bit integer that amqp091 sends for an int; use an int64", x)}
		}
		return 5, nil
	case amqp.Decimal:
		return 6, nil
	case int64, float64, time.Time:
		return 9, nil
	case string:
		return 5 + len(x), nil
	case []byte:
		return 5 + len(x), nil
	case amqp.Table:
		n, fe := tableSize(x, depth+1)
		return 1 + n, fe
	case []any:
		if depth+1 > maxNesting {
			return 0, &fieldError{why: fmt.Sprintf("tables and arrays nest %d deep here; amqp091 reads at most %d", depth+1, maxNesting)}
		}
		if len(x) > maxEntries {
			return 0, &fieldError{why: fmt.Sprintf("the array holds %d entries; amqp091 reads at most %d", len(x), maxEntries)}
		}
		size := 5
		for i, e := range x {
			n, fe := fieldSize(e, depth+1)
			if fe != nil {
				return 0, fe.under("[" + strconv.Itoa(i) + "]")
			}
			size += n
		}
		return size, nil
	case map[string]any:
		return 0, &fieldError{why: fmt.Sprintf("a %T cannot be sent in an AMQP table; use an amqp.Table", v)}
	}
	return 0, &fieldError{why: fmt.Sprintf("a %T cannot be sent in an AMQP table (amqp091 sends bool, int8, uint8, int16, uint16, int32, uint32, int64, an int within 32 bits, float32, float64, amqp.Decimal, string, []byte, time.Time, amqp.Table, []any and nil)", v)}
}
