package relay

import (
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestParseSettlements(t *testing.T) {
	s := []settlement{{seq: 3, n: 7, disp: dispDelivered}, {seq: 4, n: 9, disp: dispAbandoned}}
	got, err := ParseSettlements("ep", formatSettlements(s))
	if err != nil || len(got) != 2 || got[0].Seq != 3 || got[0].CallID != "ep/7" || got[0].Disposition != "delivered" ||
		got[1].Seq != 4 || got[1].CallID != "ep/9" || got[1].Disposition != "abandoned" {
		t.Fatalf("round trip: %+v %v", got, err)
	}
	if got, err := ParseSettlements("ep", "5.0.a"); err != nil || len(got) != 1 || got[0].CallID != "" || got[0].Seq != 5 {
		t.Fatalf("an answer no call read: %+v %v", got, err)
	}
	if got, err := ParseSettlements("ep", ""); err != nil || got != nil {
		t.Fatalf("empty: %+v %v", got, err)
	}
	for _, bad := range []string{"3.7", "3.7.x", "0.7.d", "3.0.d", "-1.2.d", "3.7.d,", "a.b.d", "3.7.d.1", "99999999999999999999.1.d",
		strings.Repeat("1.1.d,", maxSettlements) + "1.1.d"} {
		if _, err := ParseSettlements("ep", bad); err == nil {
			t.Errorf("%.40q parsed", bad)
		}
	}
}

// FuzzParseSettlements: any header either fails with an error or parses
// into settlements that format back to an equivalent header.
func FuzzParseSettlements(f *testing.F) {
	for _, s := range []string{"1.1.d", "3.7.d,4.9.a", " 2.2.a", "3.7", "x", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, h string) {
		got, err := ParseSettlements("ep", h)
		if err != nil {
			return
		}
		var back []settlement
		for _, s := range got {
			var n int64
			if s.CallID != "" { // "": an answer no call read (N 0)
				n, err = strconv.ParseInt(strings.TrimPrefix(s.CallID, "ep/"), 10, 64)
				if err != nil || n < 1 {
					t.Fatalf("%q parsed into %+v", h, s)
				}
			} else if s.Disposition != "abandoned" {
				t.Fatalf("%q: an unknown call settled %q", h, s.Disposition)
			}
			if s.Seq < 1 {
				t.Fatalf("%q parsed into %+v", h, s)
			}
			d := dispDelivered
			if s.Disposition == "abandoned" {
				d = dispAbandoned
			} else if s.Disposition != "delivered" {
				t.Fatalf("%q: disposition %q", h, s.Disposition)
			}
			back = append(back, settlement{seq: s.Seq, n: n, disp: d})
		}
		again, err := ParseSettlements("ep", formatSettlements(back))
		if err != nil || len(again) != len(got) {
			t.Fatalf("%q: formatted back: %+v %v", h, again, err)
		}
		for i := range got {
			if again[i] != got[i] {
				t.Fatalf("%q: %+v became %+v", h, got[i], again[i])
			}
		}
	})
}

// TestOutbox steps the settlements the gateway has not recorded through
// rides on calls and flushes of their own.
func TestOutbox(t *testing.T) {
	a := settlement{seq: 1, n: 1, disp: dispDelivered}
	b := settlement{seq: 2, n: 2, disp: dispAbandoned}
	c := settlement{seq: 3, n: 0, disp: dispAbandoned}
	for _, tc := range []struct {
		name     string
		steps    func(*outbox) []settlement // what the last step sent
		sent     []settlement
		unsent   []settlement
		carried  []settlement
		schedule bool // whether a flush would be scheduled now
	}{
		{"queued: a flush is due", func(o *outbox) []settlement { o.add(a, b); return nil },
			nil, []settlement{a, b}, nil, true},
		{"a call takes them along", func(o *outbox) []settlement { o.add(a, b); return o.take() },
			[]settlement{a, b}, nil, []settlement{a, b}, true},
		{"the call's answer recorded them", func(o *outbox) []settlement {
			o.add(a, b)
			s := o.take()
			o.returned(s, true)
			return s
		}, []settlement{a, b}, nil, nil, true},
		{"the call failed: they go first again", func(o *outbox) []settlement {
			o.add(a)
			s := o.take()
			o.add(b)
			o.returned(s, false)
			return s
		}, []settlement{a}, []settlement{a, b}, nil, true},
		{"another call's ride ends: only its own are done", func(o *outbox) []settlement {
			o.add(a)
			first := o.take()
			o.add(b)
			o.take()
			o.returned(first, true)
			return first
		}, []settlement{a}, nil, []settlement{b}, true},
		{"a flush takes the unsent", func(o *outbox) []settlement { o.add(a); o.take(); o.add(b); return o.batch(false) },
			[]settlement{b}, nil, []settlement{a}, true},
		{"a hold's flush takes the carried too", func(o *outbox) []settlement { o.add(a); o.take(); o.add(b); return o.batch(true) },
			[]settlement{b, a}, nil, []settlement{a}, true},
		{"a failed flush puts back what no call carries", func(o *outbox) []settlement {
			o.add(a)
			o.take()
			o.add(b, c)
			s := o.batch(true)
			o.failed(s)
			return s
		}, []settlement{b, c, a}, []settlement{b, c}, []settlement{a}, true},
		{"one flush at a time", func(o *outbox) []settlement { o.schedule(); o.add(a); return nil },
			nil, []settlement{a}, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var o outbox
			sent := tc.steps(&o)
			if !slices.Equal(sent, tc.sent) || !slices.Equal(o.unsent, tc.unsent) || !slices.Equal(o.carried, tc.carried) || o.schedule() != tc.schedule {
				t.Fatalf("sent %v, unsent %v, carried %v; want %v, %v, %v (schedule %v)", sent, o.unsent, o.carried, tc.sent, tc.unsent, tc.carried, tc.schedule)
			}
		})
	}
}

// TestOutboxFlushes: a scheduled flush ends; another is due only when
// settlements came meanwhile or the flush failed.
func TestOutboxFlushes(t *testing.T) {
	var o outbox
	o.add(settlement{seq: 1, n: 1, disp: dispDelivered})
	if !o.schedule() || o.schedule() {
		t.Fatal("the first settlement schedules one flush, and only one")
	}
	s := o.batch(false)
	if o.flushed() {
		t.Fatal("another flush is due with nothing to send")
	}
	o.failed(s)
	if !o.schedule() {
		t.Fatal("no flush could be scheduled after one ended")
	}
	o.batch(false)
	o.add(settlement{seq: 2, n: 2, disp: dispDelivered})
	if !o.flushed() {
		t.Fatal("a settlement that came during a flush has none due")
	}
}
