"""Offline stand-in for @rules_java//java:defs.bzl.

@bazel_tools//tools/jdk loads the Java rules from rules_java, which cannot be
downloaded offline.  Bazel 4 has them built in, so forward them to `native`.
Nothing in this project is written in Java.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
