package header

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
)

// CheckSenderKeys takes CC and BCC as arrays of strings only, and names
// the header and the element it refuses; other headers are not its
// business.
func TestCheckSenderKeys(t *testing.T) {
	for _, tc := range []struct {
		name string
		h    amqp.Table
		want string // "" for nil
	}{
		{"none", amqp.Table{"x": 1}, ""},
		{"arrays of strings", amqp.Table{"CC": []any{"a", "caf\xe9"}, "BCC": []any{}}, ""},
		{"other names", amqp.Table{"cc": "a", "Bcc": 7, "nested": amqp.Table{"CC": "a"}}, ""},
		{"a CC string", amqp.Table{"CC": "a"}, `"CC" is a string, not an array of strings ([]any of string), which RabbitMQ refuses by closing the channel`},
		{"a void BCC", amqp.Table{"BCC": nil}, `"BCC" is nil, not an array of strings`},
		{"a CC table", amqp.Table{"CC": amqp.Table{"a": true}}, `"CC" is a amqp091.Table, not an array of strings`},
		{"an int in CC", amqp.Table{"CC": []any{"a", int32(7)}}, `"CC"[1] is a int32, not a string: RabbitMQ would skip it, and route the message by the other keys alone`},
		{"a void in BCC", amqp.Table{"CC": []any{"a"}, "BCC": []any{nil}}, `"BCC"[0] is nil, not a string`},
	} {
		err := CheckSenderKeys(tc.h)
		if tc.want == "" {
			assert.NoError(t, err, tc.name)
			continue
		}
		if assert.Error(t, err, tc.name) {
			assert.Contains(t, err.Error(), tc.want, tc.name)
		}
	}
}
