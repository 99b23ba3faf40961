package middleware

import (
	"strconv"
	"strings"
)

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
