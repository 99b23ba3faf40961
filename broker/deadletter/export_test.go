package deadletter

import (
	"encoding/json"
	"math"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
