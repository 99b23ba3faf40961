package deadletter

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/internal/expose"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// An ExportedMessage is one line of an export (see [Inspector.Export]):
// a message's body, properties and headers, each header with its AMQP
// type, so that [Inspector.Import] publishes the same message.
type ExportedMessage struct {
	// Queue is the queue the message was read from.
	Queue      string     `json:"queue"`
	Properties Properties `json:"properties"`
	// Headers are the message's headers: see [TypedValue].
	Headers map[string]TypedValue `json:"headers,omitempty"`
	// Body is the body, in base64 (standard encoding, padded).
	Body string `json:"body"`
}

// Properties are the AMQP basic properties of a message, but the headers.
// Timestamp is written as a timestamp header is (see [TypedValue]).
type Properties struct {
	ContentType     string    `json:"content_type,omitempty"`
	ContentEncoding string    `json:"content_encoding,omitempty"`
	DeliveryMode    uint8     `json:"delivery_mode,omitempty"`
	Priority        uint8     `json:"priority,omitempty"`
	CorrelationID   string    `json:"correlation_id,omitempty"`
	ReplyTo         string    `json:"reply_to,omitempty"`
	Expiration      string    `json:"expiration,omitempty"`
	MessageID       string    `json:"message_id,omitempty"`
	Timestamp       time.Time `json:"timestamp,omitzero"`
	Type            string    `json:"type,omitempty"`
	UserID          string    `json:"user_id,omitempty"`
	AppID           string    `json:"app_id,omitempty"`
}

// A TypedValue is a header value with its AMQP type, in JSON:
//
//	{"type": "string", "value": "text"}
//
// The types, named after the Go types that amqp091 decodes them to, and
// the JSON of their values:
//
//	bool                              true or false
//	int8, uint8, int16, uint16,       a number
//	int32, uint32
//	int64                             a number, as a string (JSON numbers
//	                                  lose precision beyond 2^53 in many
//	                                  readers)
//	float32, float64                  a string that strconv.ParseFloat
//	                                  reads back exactly ("NaN", "+Inf"
//	                                  included)
//	decimal                           {"scale": 2, "value": 12345}
//	string                            a string
//	bytes                             base64
//	timestamp                         RFC 3339, UTC, in whole seconds;
//	                                  outside the years 0 to 9999, which
//	                                  RFC 3339 cannot write (a time in
//	                                  milliseconds taken for seconds),
//	                                  the Unix seconds as a string
//	void                              null (no value)
//	array                             an array of typed values
//	table                             an object of typed values
//
// A Go int is written as int32, as amqp091 sends it.
type TypedValue struct {
	Type  string          `json:"type"`
	Value json.RawMessage `json:"value,omitempty"`
}

// MarshalJSON writes p, its Timestamp as [TypedValue] writes a timestamp.
func (p Properties) MarshalJSON() ([]byte, error) {
	w := propertiesJSON{plainProperties: plainProperties(p)}
	if !p.Timestamp.IsZero() {
		w.Timestamp = raw(formatTimestamp(p.Timestamp))
	}
	return json.Marshal(w)
}

// UnmarshalJSON reads what MarshalJSON writes.
func (p *Properties) UnmarshalJSON(b []byte) error {
	var w propertiesJSON
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*p = Properties(w.plainProperties)
	p.Timestamp = time.Time{}
	if len(w.Timestamp) == 0 || string(w.Timestamp) == "null" {
		return nil
	}
	var s string
	if err := json.Unmarshal(w.Timestamp, &s); err != nil {
		return fmt.Errorf("timestamp: %w", err)
	}
	ts, err := parseTimestamp(s)
	if err != nil {
		return fmt.Errorf("timestamp: %w", err)
	}
	p.Timestamp = ts.UTC()
	return nil
}

// plainProperties has the fields of Properties, without its methods.
type plainProperties Properties

// propertiesJSON is Properties in JSON: its Timestamp, one level up,
// hides plainProperties'.
type propertiesJSON struct {
	plainProperties
	Timestamp json.RawMessage `json:"timestamp,omitempty"`
}

// formatTimestamp writes t in RFC 3339, UTC, whole seconds; or, in a
// year RFC 3339 cannot write (before 0, after 9999), as its Unix seconds
// in decimal.
func formatTimestamp(t time.Time) string {
	if y := t.UTC().Year(); y < 0 || y > 9999 {
		return strconv.FormatInt(t.Unix(), 10)
	}
	return t.UTC().Format(time.RFC3339)
}

// parseTimestamp reads what formatTimestamp writes (and any RFC 3339
// time), in whole seconds, as amqp091 decodes a timestamp.
func parseTimestamp(s string) (time.Time, error) {
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return time.Unix(n, 0), nil
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	return time.Unix(t.Unix(), 0), err
}

// ExportOptions selects the messages that [Inspector.Export]
// writes. The zero value writes them all.
type ExportOptions struct {
	Filter
	// Limit, if positive, is the largest number of messages written.
	Limit int
	// Progress, if not nil, is called as the dead-letter queue is read
	// (see ListOptions.Progress).
	Progress func(done, total int)
}

// Export writes the messages of the dead-letter queue of work
// queue queue that opts selects to w, in JSON Lines: one
// [ExportedMessage] per line, in queue order. The queue is left as it
// was: it is read as [Inspector.List] does. It returns the number of
// messages written.
func (in *Inspector) Export(ctx context.Context, queue string, w io.Writer, opts ExportOptions) (int, error) {
	snap, err := in.snapshot(ctx, queue, opts.Progress)
	if err != nil {
		return 0, err
	}
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	n := 0
	for _, dl := range snap.msgs {
		if opts.Limit > 0 && n == opts.Limit {
			break
		}
		if !opts.Filter.match(dl) {
			continue
		}
		m, err := ExportMessage(snap.dlq, dl.Delivery)
		if err == nil {
			err = enc.Encode(m)
		}
		if err != nil {
			return n, errors.Join(fmt.Errorf("deadletter: export %q: %w", dl.ID, err), snap.close(in))
		}
		n++
	}
	return n, snap.close(in)
}

// ImportOptions configures [Inspector.Import].
type ImportOptions struct {
	// To, if set, is the queue the messages are published to. Default:
	// the dead-letter queue of the work queue given to Import.
	To string
	// Progress, if not nil, is called after each message published, with
	// the number so far.
	Progress func(done int)
}

// Import publishes the messages that r holds, written by
// [Inspector.Export], to the dead-letter queue of work queue queue
// (or to opts.To), in order, each with publisher confirms, and returns the
// number published. Each goes as it was exported: body, properties and
// headers, types included, but for the properties no copy the broker
// makes carries (see the package documentation of broker): an Expiration does not
// come back (nothing in a dead-letter queue expires), it moves to
// [broker.HeaderOriginalExpiration]; UserId moves to
// [broker.HeaderUserID] (RabbitMQ refuses a publish whose user-id is not
// the connection's); a message that was not persistent goes persistent,
// its mode in [broker.HeaderOriginalDeliveryMode]. A header already there
// is kept, so a message exported from a dead-letter queue goes back
// exactly as it was. An empty MessageId stays empty.
//
// A line that is not an exported message stops the import, with an error
// that names its line; the messages before it were published. So does the
// end of ctx: the message sent by then is waited for, up to 5 seconds
// (an abort ends the wait: see [WithAbort]), and counted once confirmed.
// It refuses
// a destination queue that does not exist before publishing anything.
func (in *Inspector) Import(ctx context.Context, queue string, r io.Reader, opts ImportOptions) (int, error) {
	dest := opts.To
	if dest == "" {
		var err error
		if dest, err = deadLetterQueue(queue); err != nil {
			return 0, err
		}
	}
	s, err := expose.Dial(ctx, in.b)
	if err != nil {
		return 0, err
	}
	defer s.Close()
	if err := s.Declare(ctx, []transport.QueueSpec{{Name: dest, Passive: true}}); err != nil {
		return 0, expose.Refusal(dest, unwrapQueueError(err))
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<30)
	n, line := 0, 0
	for sc.Scan() {
		line++
		if len(sc.Bytes()) == 0 {
			continue
		}
		if err := ctx.Err(); err != nil {
			return n, fmt.Errorf("deadletter: import: stopped at line %d, not published: %w", line, err)
		}
		var m ExportedMessage
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			return n, fmt.Errorf("deadletter: import: line %d: %w", line, err)
		}
		msg, err := m.Publishing()
		if err != nil {
			return n, fmt.Errorf("deadletter: import: line %d: %w", line, err)
		}
		if sent, err := publishFinishing(ctx, s, dest, msg); err != nil {
			if sent {
				return n, fmt.Errorf("deadletter: import: line %d: publish to %q given up on before its confirm (message %q may be there all the same, uncounted): %w", line, dest, m.Properties.MessageID, err)
			}
			return n, fmt.Errorf("deadletter: import: line %d: publish to %q: %w", line, dest, err)
		}
		n++
		if opts.Progress != nil {
			opts.Progress(n)
		}
	}
	if err := sc.Err(); err != nil {
		return n, fmt.Errorf("deadletter: import: after line %d: %w", line, err)
	}
	return n, nil
}

// publishFinishing publishes msg to queue dest and waits for its confirm,
// for up to finishWithin once ctx has ended. With an error, sent says
// whether the message, given up on before the server's word, may be in
// dest all the same.
func publishFinishing(ctx context.Context, s transport.Session, dest string, msg amqp.Publishing) (sent bool, err error) {
	if err := ctx.Err(); err != nil {
		return false, err // nothing sent
	}
	send, stop := finishing(ctx)
	defer stop()
	err = s.Publish(send, "", dest, msg)
	return err != nil && send.Err() != nil, err
}

// ExportMessage returns d, read from queue, as an ExportedMessage. It fails
// only for a header of a Go type that no AMQP type holds.
func ExportMessage(queue string, d *amqp.Delivery) (*ExportedMessage, error) {
	m := &ExportedMessage{
		Queue: queue,
		Properties: Properties{
			ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
			DeliveryMode: d.DeliveryMode, Priority: d.Priority,
			CorrelationID: d.CorrelationId, ReplyTo: d.ReplyTo, Expiration: d.Expiration,
			MessageID: d.MessageId, Timestamp: d.Timestamp, Type: d.Type,
			UserID: d.UserId, AppID: d.AppId,
		},
		Body: base64.StdEncoding.EncodeToString(d.Body),
	}
	if !m.Properties.Timestamp.IsZero() {
		m.Properties.Timestamp = m.Properties.Timestamp.UTC()
	}
	if len(d.Headers) > 0 {
		m.Headers = make(map[string]TypedValue, len(d.Headers))
		for k, v := range d.Headers {
			tv, err := typed(v)
			if err != nil {
				return nil, fmt.Errorf("header %q: %w", k, err)
			}
			m.Headers[k] = tv
		}
	}
	return m, nil
}

// Publishing returns the message m describes, ready to publish as a copy
// (see [Inspector.Import]).
func (m *ExportedMessage) Publishing() (amqp.Publishing, error) {
	body, err := base64.StdEncoding.DecodeString(m.Body)
	if err != nil {
		return amqp.Publishing{}, fmt.Errorf("body: %w", err)
	}
	p := m.Properties
	var h amqp.Table
	if m.Headers != nil {
		h = make(amqp.Table, len(m.Headers))
		for k, tv := range m.Headers {
			v, err := tv.decode()
			if err != nil {
				return amqp.Publishing{}, fmt.Errorf("header %q: %w", k, err)
			}
			h[k] = v
		}
	}
	var ts time.Time
	if !p.Timestamp.IsZero() {
		ts = time.Unix(p.Timestamp.Unix(), 0) // as amqp091 decodes it
	}
	return expose.AsCopy(amqp.Publishing{
		Headers: h, ContentType: p.ContentType, ContentEncoding: p.ContentEncoding,
		DeliveryMode: p.DeliveryMode, Priority: p.Priority, CorrelationId: p.CorrelationID,
		ReplyTo: p.ReplyTo, Expiration: p.Expiration, MessageId: p.MessageID, Timestamp: ts,
		Type: p.Type, UserId: p.UserID, AppId: p.AppID, Body: body,
	}), nil
}

func raw(v any) json.RawMessage {
	b, _ := json.Marshal(v) // only called with values json encodes
	return b
}

// typed returns v with its AMQP type.
func typed(v any) (TypedValue, error) {
	num := func(t string, n int64) TypedValue { return TypedValue{t, raw(n)} }
	flt := func(t string, f float64, bits int) TypedValue {
		return TypedValue{t, raw(strconv.FormatFloat(f, 'g', -1, bits))}
	}
	switch x := v.(type) {
	case nil:
		return TypedValue{Type: "void"}, nil
	case bool:
		return TypedValue{"bool", raw(x)}, nil
	case int8:
		return num("int8", int64(x)), nil
	case uint8:
		return num("uint8", int64(x)), nil
	case int16:
		return num("int16", int64(x)), nil
	case uint16:
		return num("uint16", int64(x)), nil
	case int32:
		return num("int32", int64(x)), nil
	case int:
		if x < math.MinInt32 || x > math.MaxInt32 {
			return TypedValue{}, fmt.Errorf("int %d does not fit the int32 that amqp091 sends", x)
		}
		return num("int32", int64(x)), nil
	case uint32:
		return num("uint32", int64(x)), nil
	case int64:
		return TypedValue{"int64", raw(strconv.FormatInt(x, 10))}, nil
	case float32:
		return flt("float32", float64(x), 32), nil
	case float64:
		return flt("float64", x, 64), nil
	case amqp.Decimal:
		return TypedValue{"decimal", raw(map[string]int64{"scale": int64(x.Scale), "value": int64(x.Value)})}, nil
	case string:
		return TypedValue{"string", raw(x)}, nil
	case []byte:
		return TypedValue{"bytes", raw(base64.StdEncoding.EncodeToString(x))}, nil
	case time.Time:
		return TypedValue{"timestamp", raw(formatTimestamp(x))}, nil
	case []any:
		a := make([]TypedValue, len(x))
		for i, e := range x {
			tv, err := typed(e)
			if err != nil {
				return TypedValue{}, fmt.Errorf("[%d]: %w", i, err)
			}
			a[i] = tv
		}
		return TypedValue{"array", raw(a)}, nil
	case amqp.Table:
		t := make(map[string]TypedValue, len(x))
		for k, e := range x {
			tv, err := typed(e)
			if err != nil {
				return TypedValue{}, fmt.Errorf("%q: %w", k, err)
			}
			t[k] = tv
		}
		return TypedValue{"table", raw(t)}, nil
	}
	return TypedValue{}, fmt.Errorf("no AMQP type holds a %T", v)
}

// decode returns the Go value of tv, of the type amqp091 decodes it to.
func (tv TypedValue) decode() (any, error) {
	dec, ok := decoders[tv.Type]
	if !ok {
		return nil, fmt.Errorf("%s: unknown type %q", tv.Type, tv.Type)
	}
	v, err := dec(tv.Value)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", tv.Type, err)
	}
	return v, nil
}

// A decoder returns the Go value of the JSON of a TypedValue's Value.
type decoder func(value json.RawMessage) (any, error)

// decoders holds the decoder of each type of TypedValue (see its doc). It
// is filled by init: those of array and table decode their elements with
// it.
var decoders map[string]decoder

func init() {
	decoders = map[string]decoder{
		"void":   void,
		"bool":   as(func(b bool) (any, error) { return b, nil }),
		"int8":   integer[int8](math.MinInt8, math.MaxInt8),
		"uint8":  integer[uint8](0, math.MaxUint8),
		"int16":  integer[int16](math.MinInt16, math.MaxInt16),
		"uint16": integer[uint16](0, math.MaxUint16),
		"int32":  integer[int32](math.MinInt32, math.MaxInt32),
		"uint32": integer[uint32](0, math.MaxUint32),
		"int64":  as(func(s string) (any, error) { return strconv.ParseInt(s, 10, 64) }),
		"float32": as(func(s string) (any, error) {
			f, err := strconv.ParseFloat(s, 32)
			return float32(f), err
		}),
		"float64": as(func(s string) (any, error) { return strconv.ParseFloat(s, 64) }),
		"decimal": as(func(d struct{ Scale, Value int64 }) (any, error) {
			if d.Scale < 0 || d.Scale > math.MaxUint8 || d.Value < math.MinInt32 || d.Value > math.MaxInt32 {
				return nil, fmt.Errorf("decimal out of range: scale %d, value %d", d.Scale, d.Value)
			}
			return amqp.Decimal{Scale: uint8(d.Scale), Value: int32(d.Value)}, nil
		}),
		"string":    as(func(s string) (any, error) { return s, nil }),
		"bytes":     as(func(s string) (any, error) { return base64.StdEncoding.DecodeString(s) }),
		"timestamp": as(func(s string) (any, error) { return parseTimestamp(s) }),
		"array": as(func(a []TypedValue) (any, error) {
			out := make([]any, len(a))
			for i, e := range a {
				v, err := e.decode()
				if err != nil {
					return nil, err
				}
				out[i] = v
			}
			return out, nil
		}),
		"table": as(func(t map[string]TypedValue) (any, error) {
			out := make(amqp.Table, len(t))
			for k, e := range t {
				v, err := e.decode()
				if err != nil {
					return nil, err
				}
				out[k] = v
			}
			return out, nil
		}),
	}
}

// as returns the decoder of a value whose JSON reads as a T, which value
// turns into the header's value.
func as[T any](value func(T) (any, error)) decoder {
	return func(raw json.RawMessage) (any, error) {
		var x T
		if err := json.Unmarshal(raw, &x); err != nil {
			return nil, err
		}
		return value(x)
	}
}

// integer returns the decoder of an integer of type T, a JSON number in
// [lo, hi].
func integer[T int8 | uint8 | int16 | uint16 | int32 | uint32](lo, hi int64) decoder {
	return as(func(n int64) (any, error) {
		if n < lo || n > hi {
			return nil, fmt.Errorf("%d out of the range of %T", n, T(0))
		}
		return T(n), nil
	})
}

// void decodes no value: absent, or null.
func void(raw json.RawMessage) (any, error) {
	if len(raw) > 0 && string(raw) != "null" {
		return nil, errors.New("void with a value")
	}
	return nil, nil
}
