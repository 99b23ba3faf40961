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

// Tokens are cut from blocks of tokenBlockSize tokens written one after
// another in one string, so that a block costs one allocation rather than
// one per delivery. The current block is shared: a token costs an atomic
// increment, and the goroutine that finds the block used up makes the next
// one (when several do at once, all but one block are dropped, with their
// sequence numbers). A block stays in memory while any of its tokens does.
const tokenBlockSize = 32

type tokenBlock struct {
	s    string                // the tokens, one after another
	ends [tokenBlockSize]int32 // where each token ends in s
	next atomic.Int32          // the next token to hand out
}

var tokens atomic.Pointer[tokenBlock]

func newToken() string {
	for {
		b := tokens.Load()
		if b != nil {
			if i := b.next.Add(1) - 1; i < tokenBlockSize {
				return b.token(i)
			}
		}
		nb := newTokenBlock()
		nb.next.Store(1)
		if tokens.CompareAndSwap(b, nb) {
			return nb.token(0)
		}
	}
}

func (b *tokenBlock) token(i int32) string {
	start := int32(0)
	if i > 0 {
		start = b.ends[i-1]
	}
	return b.s[start:b.ends[i]]
}

// newTokenBlock writes a block of tokens with sequence numbers of their own.
func newTokenBlock() *tokenBlock {
	b := new(tokenBlock)
	first := tokenSeq.Add(tokenBlockSize) - tokenBlockSize + 1
	var num [16]byte
	longest := len(tokenPrefix) + len(strconv.AppendUint(num[:0], first+tokenBlockSize-1, 36))
	var sb strings.Builder
	sb.Grow(tokenBlockSize * longest)
	for i := range uint64(tokenBlockSize) {
		sb.WriteString(tokenPrefix)
		sb.Write(strconv.AppendUint(num[:0], first+i, 36))
		b.ends[i] = int32(sb.Len())
	}
	b.s = sb.String()
	return b
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
