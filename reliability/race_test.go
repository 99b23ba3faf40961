//go:build reliability && race

package reliability_test

// raceEnabled: the tests run with the race detector, and so does the
// consumer they build.
const raceEnabled = true
