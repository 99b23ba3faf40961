package pgstore

import (
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/internal/expiration"
)

// The properties column holds the AMQP properties of a message but its
// MessageId (a column of its own) and body, and its headers, whose values
// keep their AMQP types: each is a {"t": type, "v": value} object, so that
// an int16 header is sent again as an int16, a []byte as bytes, a
// timestamp as a timestamp. A header string that jsonb cannot hold as
// text (see isText) is stored as its bytes, in base64, of type "binstring".
type storedProperties struct {
	ContentType     string           `json:"content_type,omitempty"`
	ContentEncoding string           `json:"content_encoding,omitempty"`
	DeliveryMode    uint8            `json:"delivery_mode,omitempty"`
	Priority        uint8            `json:"priority,omitempty"`
	CorrelationID   string           `json:"correlation_id,omitempty"`
	ReplyTo         string           `json:"reply_to,omitempty"`
	Expiration      string           `json:"expiration,omitempty"`
	Timestamp       *time.Time       `json:"timestamp,omitempty"`
	Type            string           `json:"type,omitempty"`
	UserID          string           `json:"user_id,omitempty"`
	AppID           string           `json:"app_id,omitempty"`
	Headers         map[string]typed `json:"headers,omitempty"`
}

type typed struct {
	T string          `json:"t"`
	V json.RawMessage `json:"v,omitempty"`
}

// Limits of AMQP 0-9-1 and of amqp091, which reads back no deeper
// nesting nor larger tables.
const (
	maxShortString = 255
	maxNesting     = 32
	maxEntries     = 8192
)

func encodeProperties(exchange, key string, msg amqp.Publishing) ([]byte, error) {
	for _, f := range []struct{ name, v string }{
		{"exchange", exchange}, {"routing key", key}, {"MessageId", msg.MessageId},
		{"ContentType", msg.ContentType}, {"ContentEncoding", msg.ContentEncoding},
		{"CorrelationId", msg.CorrelationId}, {"ReplyTo", msg.ReplyTo}, {"Expiration", msg.Expiration},
		{"Type", msg.Type}, {"UserId", msg.UserId}, {"AppId", msg.AppId},
	} {
		if len(f.v) > maxShortString {
			return nil, fmt.Errorf("%s is %d bytes, over AMQP's %d", f.name, len(f.v), maxShortString)
		}
		if !isText(f.v) {
			return nil, fmt.Errorf("%s %q %s", f.name, f.v, notText)
		}
	}
	if err := expiration.Check(msg.Expiration); err != nil {
		return nil, err
	}
	p := storedProperties{
		ContentType: msg.ContentType, ContentEncoding: msg.ContentEncoding,
		DeliveryMode: msg.DeliveryMode, Priority: msg.Priority,
		CorrelationID: msg.CorrelationId, ReplyTo: msg.ReplyTo, Expiration: msg.Expiration,
		Type: msg.Type, UserID: msg.UserId, AppID: msg.AppId,
	}
	if !msg.Timestamp.IsZero() {
		ts := storedTime(msg.Timestamp)
		p.Timestamp = &ts
	}
	if len(msg.Headers) > 0 {
		if err := checkSenderKeys(msg.Headers); err != nil {
			return nil, fmt.Errorf("headers: %w", err)
		}
		h, err := encodeTable(msg.Headers, 0) // the headers nest 0 deep, as the broker counts
		if err != nil {
			return nil, fmt.Errorf("headers: %w", err)
		}
		p.Headers = h
	}
	return json.Marshal(p)
}

// senderHeaders are the headers by whose strings RabbitMQ routes a
// message besides its routing key (sender-selected distribution).
var senderHeaders = [...]string{"CC", "BCC"}

// checkSenderKeys returns why a CC or BCC header of h would not route
// the message as written. RabbitMQ takes an array of strings: it refuses
// a header of another type by closing the channel (the relay's, failing
// the publishes in flight on it), and skips an element that is not a
// string, so that the message misses a queue without a word.
func checkSenderKeys(h amqp.Table) error {
	for _, name := range senderHeaders {
		v, ok := h[name]
		if !ok {
			continue
		}
		keys, ok := v.([]any)
		if !ok {
			return fmt.Errorf("%q is %s, not an array of strings ([]any of string), which RabbitMQ refuses by closing the channel", name, typeOf(v))
		}
		for i, k := range keys {
			if _, ok := k.(string); !ok {
				return fmt.Errorf("%q[%d] is %s, not a string: RabbitMQ would skip it, and route the message by the other keys alone", name, i, typeOf(k))
			}
		}
	}
	return nil
}

// typeOf names the Go type of a header value, for an error.
func typeOf(v any) string {
	if v == nil {
		return "nil"
	}
	return fmt.Sprintf("a %T", v)
}

// notText says why a name or property that isText refuses cannot be
// written.
const notText = "is not UTF-8 text without NUL bytes, which the outbox table cannot hold"

// isText reports whether PostgreSQL's text and jsonb hold s as it is: they
// hold UTF-8 alone (encoding/json would replace the other bytes with
// U+FFFD) and no NUL (which jsonb refuses, failing the statement and the
// transaction).
func isText(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

func encodeTable(t amqp.Table, depth int) (map[string]typed, error) {
	if depth > maxNesting {
		return nil, fmt.Errorf("nested more than %d deep", maxNesting)
	}
	if len(t) > maxEntries {
		return nil, fmt.Errorf("a table of %d entries, over %d", len(t), maxEntries)
	}
	out := make(map[string]typed, len(t))
	for k, v := range t {
		if len(k) > maxShortString {
			return nil, fmt.Errorf("a header name of %d bytes, over %d", len(k), maxShortString)
		}
		if !isText(k) {
			return nil, fmt.Errorf("header name %q %s", k, notText)
		}
		tv, err := encodeValue(v, depth)
		if err != nil {
			return nil, fmt.Errorf("%q: %w", k, err)
		}
		out[k] = tv
	}
	return out, nil
}

func encodeValue(v any, depth int) (typed, error) {
	var t string
	switch x := v.(type) {
	case nil:
		return typed{T: "void"}, nil
	case bool:
		t = "bool"
	case int8:
		t = "int8"
	case uint8:
		t = "uint8"
	case int16:
		t = "int16"
	case uint16:
		t = "uint16"
	case int32:
		t = "int32"
	case uint32:
		t = "uint32"
	case int64:
		t = "int64"
	case int:
		if x < math.MinInt32 || x > math.MaxInt32 {
			return typed{}, fmt.Errorf("int %d does not fit the 32 bits amqp091 sends an int in", x)
		}
		t, v = "int32", int32(x)
	case float32:
		t = "float32"
	case float64:
		t = "float64"
	case string:
		t = "string"
		if !isText(x) {
			t, v = "binstring", []byte(x)
		}
	case []byte:
		t = "bytes"
	case time.Time:
		t, v = "timestamp", storedTime(x)
	case amqp.Decimal:
		t = "decimal"
	case amqp.Table:
		h, err := encodeTable(x, depth+1)
		if err != nil {
			return typed{}, err
		}
		b, err := json.Marshal(h)
		return typed{T: "table", V: b}, err
	case []any:
		if depth+1 > maxNesting {
			return typed{}, fmt.Errorf("nested more than %d deep", maxNesting)
		}
		if len(x) > maxEntries {
			return typed{}, fmt.Errorf("an array of %d entries, over %d", len(x), maxEntries)
		}
		a := make([]typed, len(x))
		for i, e := range x {
			var err error
			if a[i], err = encodeValue(e, depth+1); err != nil {
				return typed{}, fmt.Errorf("[%d]: %w", i, err)
			}
		}
		b, err := json.Marshal(a)
		return typed{T: "array", V: b}, err
	default:
		return typed{}, fmt.Errorf("a value of type %T, which AMQP headers cannot carry", v)
	}
	if f, ok := v.(float64); ok && (math.IsNaN(f) || math.IsInf(f, 0)) {
		return typed{}, fmt.Errorf("float %v, which JSON cannot hold", f)
	}
	if f, ok := v.(float32); ok && (math.IsNaN(float64(f)) || math.IsInf(float64(f), 0)) {
		return typed{}, fmt.Errorf("float %v, which JSON cannot hold", f)
	}
	if isNegativeZero(v) {
		return typed{T: t, V: json.RawMessage(negativeZero)}, nil
	}
	b, err := json.Marshal(v)
	return typed{T: t, V: b}, err
}

// storedTime returns t as the table stores it: in UTC. JSON writes a
// time in RFC 3339, whose offsets hold whole minutes, and drops the
// seconds of any other offset (local mean time, which Go's zone data
// gives for the dates before a zone's standard time, or a FixedZone): t
// would be read back that many seconds off. AMQP sends the instant alone
// (whole seconds of Unix time), which UTC keeps.
func storedTime(t time.Time) time.Time { return t.UTC() }

// isNegativeZero reports whether v is a float32 or float64 negative
// zero.
func isNegativeZero(v any) bool {
	switch f := v.(type) {
	case float64:
		return f == 0 && math.Signbit(f)
	case float32:
		return f == 0 && math.Signbit(float64(f))
	}
	return false
}

// negativeZero is the value of a float header of negative zero: a JSON
// string, as jsonb would drop the sign of the number.
const negativeZero = `"-0"`

// decodeProperties rebuilds the publishing that encodeProperties stored,
// without its MessageId and body.
func decodeProperties(b []byte) (amqp.Publishing, error) {
	var p storedProperties
	if err := json.Unmarshal(b, &p); err != nil {
		return amqp.Publishing{}, err
	}
	msg := amqp.Publishing{
		ContentType: p.ContentType, ContentEncoding: p.ContentEncoding,
		DeliveryMode: p.DeliveryMode, Priority: p.Priority,
		CorrelationId: p.CorrelationID, ReplyTo: p.ReplyTo, Expiration: p.Expiration,
		Type: p.Type, UserId: p.UserID, AppId: p.AppID,
	}
	if p.Timestamp != nil {
		msg.Timestamp = *p.Timestamp
	}
	if p.Headers != nil {
		h, err := decodeTable(p.Headers)
		if err != nil {
			return amqp.Publishing{}, err
		}
		msg.Headers = h
	}
	return msg, nil
}

func decodeTable(m map[string]typed) (amqp.Table, error) {
	t := make(amqp.Table, len(m))
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys) // errors name the same header every time
	for _, k := range keys {
		v, err := m[k].decode()
		if err != nil {
			return nil, fmt.Errorf("header %q: %w", k, err)
		}
		t[k] = v
	}
	return t, nil
}

func (tv typed) decode() (any, error) {
	into := func(p any) error { return json.Unmarshal(tv.V, p) }
	switch tv.T {
	case "void":
		return nil, nil
	case "bool":
		var v bool
		return v, into(&v)
	case "int8":
		var v int8
		return v, into(&v)
	case "uint8":
		var v uint8
		return v, into(&v)
	case "int16":
		var v int16
		return v, into(&v)
	case "uint16":
		var v uint16
		return v, into(&v)
	case "int32":
		var v int32
		return v, into(&v)
	case "uint32":
		var v uint32
		return v, into(&v)
	case "int64":
		var v int64
		return v, into(&v)
	case "float32":
		if string(tv.V) == negativeZero {
			return float32(math.Copysign(0, -1)), nil
		}
		var v float32
		return v, into(&v)
	case "float64":
		if string(tv.V) == negativeZero {
			return math.Copysign(0, -1), nil
		}
		var v float64
		return v, into(&v)
	case "string":
		var v string
		return v, into(&v)
	case "bytes":
		var v []byte
		return v, into(&v)
	case "binstring":
		var v []byte
		err := into(&v)
		return string(v), err
	case "timestamp":
		var v time.Time
		return v, into(&v)
	case "decimal":
		var v amqp.Decimal
		return v, into(&v)
	case "table":
		var m map[string]typed
		if err := into(&m); err != nil {
			return nil, err
		}
		return decodeTable(m)
	case "array":
		var a []typed
		if err := into(&a); err != nil {
			return nil, err
		}
		out := make([]any, len(a))
		for i, e := range a {
			v, err := e.decode()
			if err != nil {
				return nil, fmt.Errorf("[%d]: %w", i, err)
			}
			out[i] = v
		}
		return out, nil
	}
	return nil, fmt.Errorf("unknown type %q", tv.T)
}
