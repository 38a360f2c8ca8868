package coordinator

// SetStepHook has every prepare and restore of coordinators made with o
// call hook before each step; an error from it crashes the operation
// there: it returns at once, undoing and closing nothing.
func SetStepHook(o *Options, hook func(op, step, episode string) error) { o.stepHook = hook }

// ErrCrashed is in the error of an operation the step hook crashed.
var ErrCrashed = errCrashed
