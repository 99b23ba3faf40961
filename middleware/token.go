package middleware

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
)

// Tokens identify one claim: unique across processes and deliveries, and
// telling an operator who holds a key ("host/pid/random/sequence").
var (
	tokenPrefix = func() string {
		host, _ := os.Hostname()
		var b [6]byte
		if _, err := rand.Read(b[:]); err != nil {
			panic("middleware: reading random bytes: " + err.Error())
		}
		return host + "/" + strconv.Itoa(os.Getpid()) + "/" + hex.EncodeToString(b[:]) + "/"
	}()
	tokenSeq atomic.Uint64
)

// newToken returns a claim token of this process: tokenPrefix, then the
// next sequence number, in base 36.
func newToken() string {
	var buf [64]byte
	b := append(buf[:0], tokenPrefix...)
	b = strconv.AppendUint(b, tokenSeq.Add(1), 36)
	return string(b)
}

// TokenOwner returns the host and the process id that a claim token of
// [Dedup] names: its tokens are "host/pid/random/sequence". ok is false for
// a token of another form, such as the "processing" that hand-written
// consumers write.
func TokenOwner(token string) (host string, pid int, ok bool) {
	parts := strings.Split(token, "/")
	if len(parts) != 4 || parts[0] == "" {
		return "", 0, false
	}
	pid, err := strconv.Atoi(parts[1])
	if err != nil || pid <= 0 {
		return "", 0, false
	}
	return parts[0], pid, true
}
