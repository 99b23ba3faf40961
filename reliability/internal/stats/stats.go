// Package stats is what the reliability suite's consumer process reports
// when it exits: one JSON line on its standard output, which the suite
// reads. Both sides use this one type, so they cannot drift apart.
package stats

// Consumer counts what happened to one consumer process's deliveries, by
// the chain's result and by settlement.
type Consumer struct {
	Name         string `json:"name"`
	Deliveries   int64  `json:"deliveries"`
	Acked        int64  `json:"acked"`
	Duplicates   int64  `json:"duplicates"`
	Busy         int64  `json:"busy"`
	Unavailable  int64  `json:"unavailable"`
	LeaseLost    int64  `json:"lease_lost"`
	Failed       int64  `json:"failed"`
	DeadLettered int64  `json:"dead_lettered"`
	Effects      int64  `json:"effects"`
	SettleErrors int64  `json:"settle_errors"`
	Error        string `json:"error,omitempty"`
}
