package deadletter

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
)

// decode reads each type's JSON to the Go value amqp091 decodes it to,
// and refuses what the type cannot hold with an error that names the
// type.
func TestTypedValueDecode(t *testing.T) {
	cases := []struct {
		json    string
		want    any
		wantErr string
	}{
		{`{"type":"void"}`, nil, ""},
		{`{"type":"void","value":null}`, nil, ""},
		{`{"type":"void","value":1}`, nil, "void: void with a value"},
		{`{"type":"bool","value":true}`, true, ""},
		{`{"type":"bool","value":"yes"}`, nil, "bool: json: cannot unmarshal string into Go value of type bool"},
		{`{"type":"int8","value":-128}`, int8(-128), ""},
		{`{"type":"int8","value":300}`, nil, "int8: 300 out of the range of int8"},
		{`{"type":"uint8","value":-1}`, nil, "uint8: -1 out of the range of uint8"},
		{`{"type":"int16","value":-32768}`, int16(math.MinInt16), ""},
		{`{"type":"uint16","value":65535}`, uint16(math.MaxUint16), ""},
		{`{"type":"int32","value":2147483648}`, nil, "int32: 2147483648 out of the range of int32"},
		{`{"type":"uint32","value":4294967295}`, uint32(math.MaxUint32), ""},
		{`{"type":"uint32","value":1.5}`, nil, "uint32: json: cannot unmarshal number 1.5 into Go value of type int64"},
		{`{"type":"int16"}`, nil, "int16: unexpected end of JSON input"},
		{`{"type":"int64","value":"9223372036854775807"}`, int64(math.MaxInt64), ""},
		{`{"type":"int64","value":"x"}`, nil, `int64: strconv.ParseInt: parsing "x": invalid syntax`},
		{`{"type":"float32","value":"1.5"}`, float32(1.5), ""},
		{`{"type":"float32","value":"1e39"}`, nil, `float32: strconv.ParseFloat: parsing "1e39": value out of range`},
		{`{"type":"float64","value":"-Inf"}`, math.Inf(-1), ""},
		{`{"type":"float64","value":1}`, nil, "float64: json: cannot unmarshal number into Go value of type string"},
		{`{"type":"decimal","value":{"scale":2,"value":-5}}`, amqp.Decimal{Scale: 2, Value: -5}, ""},
		{`{"type":"decimal","value":{"scale":256,"value":0}}`, nil, "decimal: decimal out of range: scale 256, value 0"},
		{`{"type":"string","value":"é"}`, "é", ""},
		{`{"type":"bytes","value":"AAH/"}`, []byte{0, 1, 255}, ""},
		{`{"type":"bytes","value":"!"}`, nil, "bytes: illegal base64 data at input byte 0"},
		{`{"type":"timestamp","value":"2024-01-02T03:04:05.6Z"}`, time.Unix(1704164645, 0), ""},
		{`{"type":"timestamp","value":"soon"}`, nil, `timestamp: parsing time "soon" as "2006-01-02T15:04:05.999999999Z07:00": cannot parse "soon" as "2006"`},
		{`{"type":"array","value":[{"type":"int8","value":1},{"type":"void"}]}`, []any{int8(1), nil}, ""},
		{`{"type":"array","value":[{"type":"uint8","value":-1}]}`, nil, "array: uint8: -1 out of the range of uint8"},
		{`{"type":"table","value":{"k":{"type":"string","value":"v"}}}`, amqp.Table{"k": "v"}, ""},
		{`{"type":"table","value":{"k":{"type":"nope"}}}`, nil, `table: nope: unknown type "nope"`},
		{`{"type":"table","value":[]}`, nil, "table: json: cannot unmarshal array into Go value of type map[string]deadletter.TypedValue"},
		{`{"type":"nope"}`, nil, `nope: unknown type "nope"`},
	}
	for _, c := range cases {
		var tv TypedValue
		require.NoError(t, json.Unmarshal([]byte(c.json), &tv), c.json)
		got, err := tv.decode()
		if c.wantErr != "" {
			assert.EqualError(t, err, c.wantErr, c.json)
			assert.Nil(t, got, c.json)
			continue
		}
		if assert.NoError(t, err, c.json) {
			assert.Equal(t, c.want, got, c.json)
		}
	}
}

// Exported, purged and imported back, the messages are the same: body,
// properties, and headers type for type.
func testExportImport(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, true, fixtures.AllTypes(), "a", "b")
	require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{
		Headers: exportTypes(), Body: []byte{0, 1, 2, 0xff}, ContentType: "application/octet-stream",
		ContentEncoding: "identity", DeliveryMode: amqp.Transient, Priority: 3, CorrelationId: "corr",
		ReplyTo: "reply", Expiration: "600000", MessageId: "props", Timestamp: time.Unix(1700000000, 0),
		Type: "kind", AppId: "app",
	}), "Publish")
	before, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err, "DeadLetters")
	var out bytes.Buffer
	n, err := f.in.Export(ctx, f.q, &out, ExportOptions{})
	require.NoError(t, err, "Export")
	assert.Equal(t, 3, n, "exported")
	assert.Equal(t, 3, strings.Count(out.String(), "\n"), "lines")
	assert.Equal(t, 3, f.length(f.q+".dlq"), "dead-letter queue after the export")
	_, err = f.in.Purge(ctx, f.q, PurgeOptions{})
	require.NoError(t, err, "Purge")
	n, err = f.in.Import(ctx, f.q, bytes.NewReader(out.Bytes()), ImportOptions{})
	require.NoError(t, err, "Import")
	assert.Equal(t, 3, n, "imported")
	after, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err, "DeadLetters")
	if len(after) != len(before) {
		t.Fatalf("after the import: %v; want %v", ids(after), ids(before))
	}
	for i, b := range before {
		a := after[i]
		assert.Equal(t, b.ID, a.ID, "id")
		assert.Equal(t, b.Delivery.Body, a.Delivery.Body, b.ID+": body")
		p := func(d *amqp.Delivery) []any {
			return []any{d.ContentType, d.ContentEncoding, d.DeliveryMode, d.Priority, d.CorrelationId,
				d.ReplyTo, d.Expiration, d.MessageId, d.Timestamp, d.Type, d.UserId, d.AppId}
		}
		// The import makes a copy as the broker's are (see Import): one
		// that carried an Expiration, or was not persistent, keeps them
		// in headers.
		want := *b.Delivery
		want.Headers = maps.Clone(want.Headers)
		if want.Expiration != "" {
			want.Headers[broker.HeaderOriginalExpiration] = want.Expiration
			want.Expiration = ""
		}
		if want.DeliveryMode != amqp.Persistent {
			want.Headers[broker.HeaderOriginalDeliveryMode] = int64(want.DeliveryMode)
			want.DeliveryMode = amqp.Persistent
		}
		equalTypes(t, b.ID+": headers", a.Delivery.Headers, want.Headers)
		assert.Equal(t, p(&want), p(a.Delivery), b.ID+": properties")
	}
	_, err = f.in.Import(ctx, f.q, strings.NewReader("{}\nnot json\n"), ImportOptions{})
	assert.Contains(t, fmt.Sprint(err), "line 2", "Import of a bad line")
	_, err = f.in.Import(ctx, f.q, strings.NewReader(""), ImportOptions{To: f.q + "-missing"})
	require.ErrorIs(t, err, broker.ErrQueueNotFound, "Import to a missing queue")
	f.drain(f.q + ".dlq")
	f.assertSettled(t)
}

// A timestamp is any number of seconds on the wire, and amqp091 reads it
// whole: one in milliseconds (a producer's common mistake) is in the year
// 57000, one of a negative number before the year 0, beyond what RFC 3339
// can write. Such a message is exported, and imported back the same, its
// property and its headers (at the top, nested, in an array).
func testExportImportTimestampsBeyondRFC3339(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	stamps := map[string]time.Time{
		"ms":       time.Unix(1764000000000, 0),
		"negative": time.Unix(-1<<40, 0),
		"max":      time.Unix(math.MaxInt64, 0),
		"year0":    time.Date(0, 1, 1, 0, 0, 0, 0, time.UTC),
		"year9999": time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC),
	}
	for id, ts := range stamps {
		require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{
			MessageId: id, Timestamp: ts, Body: []byte(id),
			Headers: amqp.Table{"at": ts, "nested": amqp.Table{"at": ts}, "list": []any{ts}},
		}), "Publish(%s)", id)
	}
	before, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err, "List")
	require.Len(t, before, len(stamps), "dead-letter queue before the export")
	var out bytes.Buffer
	n, err := f.in.Export(ctx, f.q, &out, ExportOptions{})
	require.NoError(t, err, "Export")
	require.Equal(t, len(stamps), n, "exported")
	_, err = f.in.Purge(ctx, f.q, PurgeOptions{})
	require.NoError(t, err, "Purge")
	n, err = f.in.Import(ctx, f.q, bytes.NewReader(out.Bytes()), ImportOptions{})
	require.NoError(t, err, "Import")
	require.Equal(t, len(stamps), n, "imported")
	after, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err, "List")
	require.Len(t, after, len(stamps), "dead-letter queue after the import")
	for i, a := range after {
		b := before[i].Delivery
		assert.Equal(t, b.Timestamp.Unix(), a.Delivery.Timestamp.Unix(), a.ID+": timestamp")
		equalTypes(t, a.ID+": headers", a.Delivery.Headers, b.Headers)
	}
	f.drain(f.q + ".dlq")
	f.assertSettled(t)
}

// exportTypes has a header of every AMQP type amqp091 supports, as
// amqp091 decodes them, with their extreme values. (Not an infinite or
// NaN float: RabbitMQ 3.10 closes the connection with INTERNAL_ERROR on
// one; TestTypedValueRoundTrip checks those without a server.)
func exportTypes() amqp.Table {
	return amqp.Table{
		"bool": false, "uint8": uint8(255), "int8": int8(-128), "int16": int16(math.MinInt16),
		"uint16": uint16(math.MaxUint16), "int32": int32(math.MinInt32), "uint32": uint32(math.MaxUint32),
		"int64": int64(math.MaxInt64), "float32": float32(math.SmallestNonzeroFloat32), "float64": math.MaxFloat64,
		"decimal": amqp.Decimal{Scale: 255, Value: math.MinInt32}, "string": "",
		"bytes": []byte{}, "time": time.Unix(0, 0), "void": nil, "array": []any{}, "table": amqp.Table{},
		"nested": []any{amqp.Table{"a": []any{[]byte("x"), nil, amqp.Table{"t": time.Unix(1, 0)}}}},
	}
}

// equalTypes reports a difference between got and want, Go types
// included, key by key.
func equalTypes(t *testing.T, what string, got, want amqp.Table) {
	t.Helper()
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			t.Errorf("%s: %s missing; want %T %v", what, k, w, w)
		} else if !reflect.DeepEqual(g, w) {
			t.Errorf("%s: %s = %T %#v; want %T %#v", what, k, g, g, w, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: %s = %T %v; want none", what, k, g, g)
		}
	}
}

// The typed JSON of headers reads back type for type, without a server:
// every type, extreme values, NaN.
func TestTypedValueRoundTrip(t *testing.T) {
	for name, h := range map[string]amqp.Table{"allTypes": fixtures.AllTypes(), "exportTypes": exportTypes()} {
		d := &amqp.Delivery{Headers: h, Body: []byte("b"), MessageId: "m", Timestamp: time.Unix(5, 0), DeliveryMode: amqp.Persistent}
		m, err := ExportMessage("q", d)
		require.NoError(t, err, "Export")
		line, err := json.Marshal(m)
		require.NoError(t, err, "Marshal")
		var back ExportedMessage
		require.NoError(t, json.Unmarshal(line, &back), "Unmarshal")
		p, err := back.Publishing()
		require.NoError(t, err, "Publishing")
		want := rabbit.WireTable(h) // as the wire decodes it: int becomes int32
		equalTypes(t, name, p.Headers, want)
		assert.Equal(t, d.Timestamp, p.Timestamp, name+": timestamp")
	}
	m, err := ExportMessage("q", &amqp.Delivery{Headers: amqp.Table{"nan": math.NaN(), "nan32": float32(math.NaN()), "inf": math.Inf(-1)}})
	require.NoError(t, err, "Export")
	p, err := m.Publishing()
	require.NoError(t, err, "Publishing")
	if f, ok := p.Headers["nan"].(float64); !ok || !math.IsNaN(f) {
		t.Errorf("nan = %T %v; want float64 NaN", p.Headers["nan"], p.Headers["nan"])
	}
	if f, ok := p.Headers["nan32"].(float32); !ok || !math.IsNaN(float64(f)) {
		t.Errorf("nan32 = %T %v; want float32 NaN", p.Headers["nan32"], p.Headers["nan32"])
	}
	assert.Equal(t, math.Inf(-1), p.Headers["inf"], "inf")
	if _, err := ExportMessage("q", &amqp.Delivery{Headers: amqp.Table{"bad": struct{}{}}}); err == nil {
		t.Error("Export of a header of no AMQP type = nil; want an error")
	}
	for _, bad := range []string{
		`{"type":"int8","value":300}`, `{"type":"nope"}`, `{"type":"bytes","value":"!"}`,
		`{"type":"void","value":1}`, `{"type":"decimal","value":{"scale":-1,"value":0}}`,
		`{"type":"array","value":[{"type":"uint8","value":-1}]}`, `{"type":"timestamp","value":"soon"}`,
	} {
		var tv TypedValue
		require.NoError(t, json.Unmarshal([]byte(bad), &tv), "Unmarshal")
		if _, err := tv.decode(); err == nil {
			t.Errorf("decode(%s) = nil error; want one", bad)
		}
	}
}

// An import whose context ends (the command's Ctrl-C) while a message
// awaits its confirm finishes that message, and publishes no other: the
// count it returns is the number of messages in the queue, so that the
// rest of the file can be imported on its own. On a server that takes
// 200 ms to confirm, the context ends as the first message is in its
// queue.
func TestImportInterruptedFinishesWhatItSent(t *testing.T) {
	f := setup(t, backends[0], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	var file strings.Builder
	for i := range 3 {
		m, err := ExportMessage(f.q+".dlq", &amqp.Delivery{MessageId: fmt.Sprintf("m%d", i), Body: []byte("body")})
		require.NoError(t, err)
		line, err := json.Marshal(m)
		require.NoError(t, err)
		file.Write(append(line, '\n'))
	}
	f.mem.SetConfirmDelay(200 * time.Millisecond)
	ictx, interrupt := context.WithCancel(ctx)
	defer interrupt()
	go func() {
		defer interrupt()
		assert.Eventually(t, func() bool { return f.length(f.q+".dlq") > 0 }, 10*time.Second, time.Millisecond)
	}()
	n, err := f.in.Import(ictx, f.q, strings.NewReader(file.String()), ImportOptions{})
	require.ErrorIs(t, err, context.Canceled, "Import")
	assert.ErrorContains(t, err, "line 2")
	f.mem.SetConfirmDelay(0)
	assert.Equal(t, 1, n, "imported")
	assert.Equal(t, []string{"m0"}, deliveryIDs(f.drain(f.q+".dlq")), "dead-letter queue")
	f.assertSettled(t)
}
